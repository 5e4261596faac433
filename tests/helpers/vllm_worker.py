# SPDX-License-Identifier: Apache-2.0
"""Runs a MiniMax-M3 checkpoint on vLLM's CPU platform (with whatever vLLM plugins are
installed: openmsa's among them) and writes each request's greedy tokens and their
log-probabilities as JSON. tests/test_vllm.py runs it in a subprocess:

    python vllm_worker.py CHECKPOINT REQUEST_JSON OUT_JSON

REQUEST_JSON: {"prompts": [[ids]], "max_tokens": n, "max_num_batched_tokens": n,
"llm": {more LLM(...) keywords}, "stock_metadata": bool}; OUT_JSON: {"requests": [{"tokens",
"logprobs"}], "decode_q_lens": the q_lens of the steps' decode rows}. With "stock_metadata", openmsa's
builders attach nothing and the impls rebuild the whole step from vLLM's split metadata, as they
do on vLLM 0.24-0.26 (where the main branch's builder is vLLM's).
"""

import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# engine core in this process: one process to watch, stderr holds the whole log
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main(checkpoint: str, request: str, out: str) -> None:
    from vllm import LLM, SamplingParams

    with open(request) as f:
        req = json.load(f)
    from openmsa.integrations.vllm import impls

    attach = impls._with_whole_step
    decode_q_lens = set()

    def record(md, common):
        # the decode rows' q_len of every step (> 1: spec-decode verify steps)
        if md.num_decodes:
            decode_q_lens.add(md.decode.decode_query_len)
        return md if req.get("stock_metadata") else attach(md, common)

    impls._with_whole_step = record
    llm = LLM(model=checkpoint, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=4096, block_size=128, seed=0,
              max_num_batched_tokens=req["max_num_batched_tokens"],
              enable_chunked_prefill=True, enable_prefix_caching=False, **req.get("llm", {}))
    params = SamplingParams(max_tokens=req["max_tokens"], temperature=0.0, logprobs=0,
                            ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], params)
    result = []
    for o in outputs:
        c = o.outputs[0]
        result.append({"tokens": list(c.token_ids),
                       "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]})
    with open(out, "w") as f:
        json.dump({"requests": result, "decode_q_lens": sorted(decode_q_lens)}, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
