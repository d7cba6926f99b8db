"""vLLM's own offline ``LLM.generate`` over multi-turn conversations: the anchor of the fidelity tests.

    python -m tests.engines.vllm_offline SPEC.json OUT.json

SPEC: ``{"runs": [{"model": DIR, "engine": {LLM kwargs}, "conversations": [[{"token_ids": [...],
"sampling": {...}, "images": [HxWx3 uint8 nested lists]}, ...], ...]}, ...]}`` (``images``
optional). Each conversation's context is kept here, independently of the fleet: turn k's prompt is
the conversation's earlier prompts and generations plus its own ids, with every image so far as
``multi_modal_data`` (its ``token_ids`` hold one image token per image; vLLM expands them). All
conversations' turn k go to one ``LLM.generate`` call. OUT: per run, per conversation, per turn,
``{"token_ids", "logprobs", "finish_reason", "context_length"}`` (context length counted in vLLM's
expanded prompt) (+ ``"routed_experts"`` as nested lists when the engine returns them, ``"top_logprobs"``
(per token, the k ``[token_id, logprob]`` pairs of rank <= k, in rank order) when the turn asks for
``logprobs`` k > 0, and ``"stop_reason"`` (vLLM's: the stop string or stop token id) when it has one).

vLLM starts engine processes: this runs as its own process, under the ``__main__`` guard.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def run(spec: dict[str, Any]) -> list[list[dict[str, Any]]]:
    import numpy as np
    from PIL import Image
    from vllm import LLM
    from vllm.sampling_params import SamplingParams

    from schemas.messages import SamplingParams as OurSampling
    from workers.engines.token_sessions import DEFAULT_SEED, sampling_fields

    llm = LLM(model=spec["model"], **spec.get("engine", {}))
    conversations: list[list[dict[str, Any]]] = spec["conversations"]
    contexts: list[list[int]] = [[] for _ in conversations]
    images: list[list[Any]] = [[] for _ in conversations]
    results: list[list[dict[str, Any]]] = [[] for _ in conversations]
    turns = max(len(c) for c in conversations)
    for turn in range(turns):
        live = [i for i, c in enumerate(conversations) if turn < len(c)]
        prompts = []
        params = []
        for i in live:
            step = conversations[i][turn]
            contexts[i] = [*contexts[i], *step["token_ids"]]
            images[i].extend(Image.fromarray(np.asarray(a, dtype=np.uint8)) for a in step.get("images", []))
            prompt: dict[str, Any] = {"prompt_token_ids": contexts[i]}
            if images[i]:
                prompt["multi_modal_data"] = {"image": list(images[i])}
            prompts.append(prompt)
            sampling = OurSampling.from_wire(step.get("sampling"))
            params.append(SamplingParams(**sampling_fields(sampling, DEFAULT_SEED)))
        outs = llm.generate(prompts, params, use_tqdm=False)
        for i, out in zip(live, outs, strict=True):
            completion = out.outputs[0]
            ids = [int(t) for t in completion.token_ids]
            logprobs = [float(entry[t].logprob) for t, entry in zip(ids, completion.logprobs, strict=True)]
            contexts[i] = [*contexts[i], *ids]
            entry = {"token_ids": ids, "logprobs": logprobs, "finish_reason": completion.finish_reason,
                     "context_length": len(out.prompt_token_ids) + len(ids)}
            k = params[live.index(i)].logprobs
            if k:  # by vLLM's ranks: the sampled token is listed whatever its rank
                entry["top_logprobs"] = [[[int(t), float(lp.logprob)] for t, lp in
                                          sorted(position.items(), key=lambda item: item[1].rank)
                                          if lp.rank <= k] for position in completion.logprobs]
            if completion.stop_reason is not None:
                entry["stop_reason"] = completion.stop_reason
            if completion.routed_experts is not None:
                entry["routed_experts"] = completion.routed_experts.tolist()
            results[i].append(entry)
    del llm
    return results


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        spec = json.load(f)
    results = [run(one) for one in spec["runs"]]
    with open(argv[1], "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
