"""The Python frames between ``LLMEngine.step`` and each backend function one decode
step reaches (the forward's kernels, the sampler): how deep the step loop is.

    python benchmarks/hops.py [MODEL] [--backend torch]

Prints the deepest chain in full and, per backend function, its depth.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch  # noqa: F401  (as a user's script: torch before infer)

from infer import LLM, SamplingParams


def chains_of_one_decode_step(llm: LLM) -> dict[str, list[str]]:
    chains: dict[str, list[str]] = {}

    def profile(frame, event, arg):
        if event != "call" or f"{os.sep}infer{os.sep}backends{os.sep}" not in frame.f_code.co_filename:
            return
        names, fr = [], frame
        while fr is not None:
            names.append(f"{os.path.basename(fr.f_code.co_filename)}:{fr.f_code.co_qualname}")
            if fr.f_code.co_name == "step" and fr.f_code.co_filename.endswith("engine.py"):
                break
            fr = fr.f_back
        if fr is not None and len(names) > len(chains.get(names[0], ())):
            chains[names[0]] = names[::-1]

    engine = llm.engine
    engine.add_request("hops", "The capital of France is", SamplingParams(max_tokens=4, temperature=0))
    engine.step()  # the prompt
    sys.setprofile(profile)
    try:
        engine.step()  # one decode step
    finally:
        sys.setprofile(None)
    return chains


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="smollm2")
    parser.add_argument("--backend", default="torch")
    args = parser.parse_args()
    llm = LLM(args.model, backend=args.backend, enforce_eager=True, max_model_len=256)
    chains = chains_of_one_decode_step(llm)
    deepest = max(chains.values(), key=len)
    print(f"deepest: {len(deepest) - 1} frames below LLMEngine.step")
    for name in deepest:
        print("   ", name)
    for name in sorted(chains, key=lambda k: (len(chains[k]), k)):
        print(f"{len(chains[name]) - 1:3d}  {name}  via {' > '.join(n.split(':')[1] for n in chains[name][1:4])}")


if __name__ == "__main__":
    main()
