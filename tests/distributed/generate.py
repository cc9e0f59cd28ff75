"""Greedy generation with LLM(...) for the distributed tests: ``python generate.py JSON``.

JSON: {"model": ..., "engine": {EngineArgs fields}, "prompts": [[ids], ...], "max_tokens": N}; with
LoRA, "loras": [[name, id, path], ...] and "lora_of": per prompt an index into loras or null.
Prints one JSON line (or writes OUT/rank<r>.json when "out" is given): the token ids
and, per token, the top-5 logprobs of every prompt.
Run directly (the mp executor starts the other ranks) or under torchrun
(every rank prints; with "rank_args", rank r's engine fields are updated by
rank_args[str(r)] — how a test makes ranks disagree).
"""

import json
import os
import sys

import torch  # noqa: F401  (as a user's script would: torch before infer)

from infer import LLM, SamplingParams


def main() -> None:
    spec = json.loads(sys.argv[1])
    engine = dict(spec.get("engine", {}))
    engine.update(spec.get("rank_args", {}).get(os.environ.get("RANK", "0"), {}))
    llm = LLM(spec["model"], skip_tokenizer_init=True, **engine)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0, logprobs=5)
    from infer.core.lora import LoRARequest

    loras = [LoRARequest(*x) for x in spec.get("loras", ())]
    lora_of = [None if i is None else loras[i] for i in spec["lora_of"]] if loras else None
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False,
                        lora_request=lora_of)
    result = {"rank": int(os.environ.get("RANK", 0)),
              "tokens": [o.outputs[0].token_ids for o in outs],
              "logprobs": [[{str(k): v.logprob for k, v in step.items()} for step in o.outputs[0].logprobs] for o in outs]}
    stats = llm.engine.scheduler.get_stats()
    result["preemptions"], result["swapped_out"] = stats.num_preemptions, stats.num_swapped_out
    spec_stats = llm.engine.spec_stats
    result["draft_tokens"], result["accepted_tokens"] = spec_stats.num_draft_tokens, spec_stats.num_accepted_tokens
    if spec.get("weight_bytes"):
        from infer.bench.runners import held_bytes

        result["weight_bytes"] = held_bytes(llm.engine.worker.runner)
    llm.engine.shutdown()
    if spec.get("out"):  # one file per rank: ranks sharing a stdout pipe can interleave long lines
        with open(os.path.join(spec["out"], f"rank{result['rank']}.json"), "w") as f:
            json.dump(result, f)
    else:
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
