"""The engine on the tiny GPT-OSS MXFP4 checkpoint through the TPU MoE kernel in the
Pallas interpreter: LLM(quantization="mxfp4", moe_backend="tpu") keeps the experts in
the packed layout, the kernel decodes them (float32 activations: the gather kernel's
one-part rows, K halves sliced in the kernel), and the greedy tokens of the two golden
prompts must be transformers' (tests/golden/tiny-gpt-oss-mxfp4.npz, made on the
dequantised weights). Run by hand: an interpreted engine compile costs more than the
test budget allows (tests/test_quant_loading.py checks the same tokens through xla).

    .venv/bin/python launch/compile_mxfp4_engine_golden.py
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from checkpoints.make_tiny import ensure_tiny  # noqa: E402
from lp_jax import LLM, SamplingParams  # noqa: E402
from pallas_kernels.moe import tpu  # noqa: E402

GOLDEN = "tests/golden/tiny-gpt-oss-mxfp4.npz"


def main():
    os.environ["LP_JAX_PALLAS_INTERPRET"] = "1"  # read when the kernels trace
    golden = np.load(GOLDEN)
    prompts = [golden[f"prompt_{i}"].tolist() for i in (1, 2)]
    want = [golden[f"greedy_{i}"][:4].tolist() for i in (1, 2)]
    schemes, kernel = [], tpu.moe_ffn_tpu

    def spy(*a, **kw):  # which weight format reaches the TPU kernel
        schemes.append(kw.get("scheme"))
        return kernel(*a, **kw)

    tpu.moe_ffn_tpu = spy
    t0 = time.perf_counter()
    llm = LLM(str(ensure_tiny(preset="tiny-gpt-oss-mxfp4")), quantization="mxfp4",
              max_num_seqs=2, max_model_len=64, moe_backend="tpu", attention_backend="xla",
              scheduling="orca", max_num_batched_tokens=16, token_buckets=(66,), log=None)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True))
    got = [o.token_ids for o in outs]
    print(f"schemes through the TPU kernel: {sorted({s.name for s in schemes})}; "
          f"greedy {got}, golden {want}: {'EQUAL' if got == want else 'DIFFERENT'} "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0 if got == want and schemes else 1


if __name__ == "__main__":
    sys.exit(main())
