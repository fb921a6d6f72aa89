"""One process of the 2-process engine in test_multiprocess.py (not a test module).

    python tests/multiprocess_worker.py MODEL_DIR OUT_JSON
with LP_NUM_PROCESSES / LP_PROCESS_ID / LP_COORDINATOR_ADDRESS set: builds a chunked engine
(plan channel "host") on a (2, 4) expert x tensor mesh over both processes (attention over
the 4 tensor devices of a process, its 2 KV heads kept twice; the experts over all 8),
then a layered engine (plan channel "device") with data-parallel attention, DP 2 x TP 4 (a
data rank a process, its own half of the KV pool; the experts over all 8), and the leader
writes each run's greedy tokens, plan-channel stats and
layout to OUT_JSON.
"""

import json
import sys

from lp_jax import LLM, SamplingParams
from tests.multiprocess_common import DP_PAGES, ENGINE_ARGS, NEW_TOKENS, PROMPTS

model_dir, out_path = sys.argv[1], sys.argv[2]
results = {}
RUNS = {"chunked": dict(scheduling="chunked", mesh_shape=(2, 4), plan_channel="host"),
        "dp": dict(scheduling="layered", data_parallel_size=2, tensor_parallel_size=4,
                   enable_expert_parallel=True, plan_channel="device",
                   max_model_len=16 * DP_PAGES, kv_pages=2 * DP_PAGES)}
for name, kwargs in RUNS.items():
    llm = LLM(model_dir, **kwargs, **ENGINE_ARGS)
    outs = llm.generate(prompt_token_ids=PROMPTS,
                        sampling_params=SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    if llm.is_leader:
        stats = llm.stats()
        kv = llm.engine.runner.kv_pages
        experts = llm.engine.runner.state["model"]["layers"]["mlp"]["experts_gate_up_proj"]
        layout = {"kv_heads": kv.shape[2] // 2,
                  "kv_heads_per_device": kv.sharding.shard_shape(kv.shape)[2] // 2,
                  "expert_devices": len(experts[...].sharding.device_set)}
        if name == "dp":  # which process's devices hold each pool row block
            layout["pool_rows_per_device"] = kv.sharding.shard_shape(kv.shape)[0]
            layout["pool_rows"] = kv.shape[0]
            mesh = kv.sharding.mesh  # (data, expert, tensor): the processes of each rank
            layout["rank_processes"] = [sorted({d.process_index for d in mesh.devices[r].ravel()})
                                        for r in range(2)]
            layout["data_parallel"] = stats["data_parallel"]
            layout["free_pages"] = [stats["free_pages"], stats["total_pages"]]
        results[name] = {"tokens": [o.token_ids for o in outs],
                         "plan_channel": stats["plan_channel"],
                         "compilations_after_warmup": stats["compilations_after_warmup"],
                         "layout": layout}
    llm.shutdown()
if results:
    with open(out_path, "w") as f:
        json.dump(results, f)
