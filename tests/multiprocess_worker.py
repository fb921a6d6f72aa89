"""One process of the 2-process engine in test_multiprocess.py (not a test module).

    python tests/multiprocess_worker.py MODEL_DIR OUT_JSON
with LP_NUM_PROCESSES / LP_PROCESS_ID / LP_COORDINATOR_ADDRESS set: builds a chunked and
then a layered engine (plan channels "host", then "device") on a (2, 4) expert x tensor
mesh over both processes (attention over the 4 tensor devices of a process, its 2 KV
heads kept twice; the experts over all 8), and the leader writes each policy's greedy
tokens, plan-channel stats and that layout to OUT_JSON.
"""

import json
import sys

from lp_jax import LLM, SamplingParams
from tests.multiprocess_common import ENGINE_ARGS, NEW_TOKENS, PROMPTS

model_dir, out_path = sys.argv[1], sys.argv[2]
results = {}
for policy, transport in (("chunked", "host"), ("layered", "device")):
    llm = LLM(model_dir, scheduling=policy, mesh_shape=(2, 4), plan_channel=transport,
              **ENGINE_ARGS)
    outs = llm.generate(prompt_token_ids=PROMPTS,
                        sampling_params=SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    if llm.is_leader:
        stats = llm.stats()
        kv = llm.engine.runner.kv_pages
        experts = llm.engine.runner.state["model"]["layers"]["mlp"]["experts_gate_up_proj"]
        layout = {"kv_heads": kv.shape[2] // 2,
                  "kv_heads_per_device": kv.sharding.shard_shape(kv.shape)[2] // 2,
                  "expert_devices": len(experts[...].sharding.device_set)}
        results[policy] = {"tokens": [o.token_ids for o in outs],
                           "plan_channel": stats["plan_channel"],
                           "compilations_after_warmup": stats["compilations_after_warmup"],
                           "layout": layout}
    llm.shutdown()
if results:
    with open(out_path, "w") as f:
        json.dump(results, f)
