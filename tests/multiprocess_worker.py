"""One process of the 2-process engine in test_multiprocess.py (not a test module).

    python tests/multiprocess_worker.py MODEL_DIR MTP_DIR EAGLE3_DIR OUT_JSON
with LP_NUM_PROCESSES / LP_PROCESS_ID / LP_COORDINATOR_ADDRESS set: builds a chunked engine
(plan channel "host") of MODEL_DIR (tiny) with the EAGLE-3 head EAGLE3_DIR on a (2, 4)
expert x tensor mesh over both processes (attention over the 4 tensor devices of a
process, its 2 KV heads kept twice; the experts over all 8), then a layered engine (plan
channel "device") of MTP_DIR (tiny-deepseek with a next-token layer) with MTP drafts and
data-parallel attention, DP 2 x TP 4 (a data rank a process, its own half of the
target's and the draft's KV pools; the experts over all 8), and the leader writes each
run's greedy tokens, plan-channel stats, draft counts and layout to OUT_JSON.
"""

import json
import sys

import jax

from lp_jax import LLM, SamplingParams
from tests.multiprocess_common import (
    DP_PAGES,
    ENGINE_ARGS,
    MTP_DRAFTS,
    MTP_NEW_TOKENS,
    MTP_PROMPTS,
    NEW_TOKENS,
    PROMPTS,
    eagle3_config,
)

model_dir, mtp_dir, eagle3_dir, out_path = sys.argv[1:5]
results = {}
RUNS = {"chunked": (model_dir, PROMPTS, NEW_TOKENS, dict(
            scheduling="chunked", mesh_shape=(2, 4), plan_channel="host",
            speculative_config=eagle3_config(eagle3_dir))),
        "dp": (mtp_dir, MTP_PROMPTS, MTP_NEW_TOKENS, dict(
            scheduling="layered", data_parallel_size=2, tensor_parallel_size=4,
            enable_expert_parallel=True, plan_channel="device",
            max_model_len=16 * DP_PAGES, kv_pages=2 * DP_PAGES,
            speculative_config={"method": "mtp", "num_speculative_tokens": MTP_DRAFTS}))}


def expert_devices(state) -> int:
    """Devices holding the routed experts' gate/up weights."""
    (x,) = [x for path, x in jax.tree_util.tree_leaves_with_path(state)
            if "experts_gate_up_proj" in jax.tree_util.keystr(path)]
    return len(x.sharding.device_set)


def record_drafting(scheduler) -> dict:
    """{seq_id: steps that left it with drafts}, filled as the leader commits steps."""
    drafting, commit = {}, scheduler.commit

    def recording(plan, result, now):
        done = commit(plan, result, now)
        for seq in plan.sampling_seqs:
            if seq.draft_tokens:
                drafting[seq.seq_id] = drafting.get(seq.seq_id, 0) + 1
        return done

    scheduler.commit = recording
    return drafting


for name, (path, prompts, new_tokens, kwargs) in RUNS.items():
    llm = LLM(path, **kwargs, **ENGINE_ARGS)
    drafting = record_drafting(llm.engine.scheduler) if llm.is_leader else {}
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(max_tokens=new_tokens, temperature=0.0))
    if llm.is_leader:
        stats = llm.stats()
        kv = llm.engine.runner.kv_pages
        layout = {"kv_heads": kv.shape[2] // 2,
                  "kv_heads_per_device": kv.sharding.shard_shape(kv.shape)[2] // 2,
                  "expert_devices": expert_devices(llm.engine.runner.state)}
        results[f"spec_{name}"] = {k: stats[k] for k in (
            "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens", "startup_compilations", "programs")}
        results[f"spec_{name}"]["drafting_steps"] = sorted(drafting.values())
        if name == "dp":  # which process's devices hold each pool row block
            layout["pool_rows_per_device"] = kv.sharding.shard_shape(kv.shape)[0]
            layout["pool_rows"] = kv.shape[0]
            mesh = kv.sharding.mesh  # (data, expert, tensor): the processes of each rank
            layout["rank_processes"] = [sorted({d.process_index for d in mesh.devices[r].ravel()})
                                        for r in range(2)]
            layout["data_parallel"] = stats["data_parallel"]
            layout["free_pages"] = [stats["free_pages"], stats["total_pages"]]
            draft_kv = llm.engine.runner.draft_state["kv"]
            layout["draft_pool_rows_per_device"] = draft_kv.sharding.shard_shape(
                draft_kv.shape)[0]
            layout["draft_pool_rows"] = draft_kv.shape[0]
        results[name] = {"tokens": [o.token_ids for o in outs],
                         "plan_channel": stats["plan_channel"],
                         "compilations_after_warmup": stats["compilations_after_warmup"],
                         "layout": layout}
    llm.shutdown()
if results:
    with open(out_path, "w") as f:
        json.dump(results, f)
