"""Would a layer-skipping draft (self-speculative decoding) pay here? Measured, not built.

    python docs/results/self_speculation.py [--tokens 64] [--layers 8,12,16,20]

For each of the 8 example prompts (assets/examples.json) the embedded model decodes greedily; then
one teacher-forced forward over prompt + reply gives every decoder layer's state. An early-exit
draft at layer L (the final norm and the output head applied to layer L's state: the logit lens)
proposes position t's token from the same prefix the full model saw, because the layers below L are
shared, so its draft is accepted exactly where the lens's argmax equals the model's greedy token. A
draft token costs L layers plus the output head (by weights: 0.42 of a forward at L = 8 here).

Speculation is simulated along each reply from those agreements (no independence assumed): a cycle
drafts k tokens, the full model checks them in one forward of k + 1 tokens
(measured below on this CPU, in CPU time, interleaved with one-token forwards), and the reply
advances by the accepted run plus the token the check adds. Speedup = tokens per cycle ÷ the cycle's
cost in one-token forwards. Beside it, the same on a memory-bound GPU, where a forward of k + 1
tokens costs about one forward (weights read once), is stated as the bound it is.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import sys

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the repository's package

import feedback  # noqa: E402,F401  (first: it sets the CPU wait policy before torch loads)
import torch  # noqa: E402

from feedback.core.engine import run_to_end  # noqa: E402
from feedback.core.model import load_model  # noqa: E402
from feedback.core.records import RowSpec, RunConfig  # noqa: E402
DRAFTS = (1, 2, 3, 4, 6, 8)


def agreements(lm, prompt: str, tokens: int, layers: list[int]) -> dict[int, list[bool]]:
    """Per layer, for each reply token: does the layer's logit-lens argmax equal the greedy token?"""
    run = run_to_end(lm, RunConfig(prompt=prompt, max_new_tokens=tokens, rows=[RowSpec("greedy")]))
    reply = run.rows[0].token_ids
    prompt_ids = lm.encode(prompt)
    ids = torch.tensor([prompt_ids + reply])
    with torch.inference_mode():
        out = lm.model(input_ids=ids, output_hidden_states=True)
        final = out.logits[0].argmax(-1)
        norm, head = lm.model.model.norm, lm.model.get_output_embeddings()
        first = len(prompt_ids) - 1  # the position whose next token is the reply's first
        positions = range(first, first + len(reply))
        assert [int(final[p]) for p in positions] == reply, "teacher-forced argmax must be the greedy reply"
        return {layer: [bool(x) for x in (head(norm(out.hidden_states[layer][0]))).argmax(-1)[first:first + len(reply)]
                        .eq(torch.tensor(reply))] for layer in layers}


def simulate(agree: list[bool], k: int) -> tuple[int, int]:
    """(tokens produced, cycles) drafting k tokens a cycle along one reply."""
    pos, cycles = 0, 0
    while pos < len(agree):
        run = 0
        while run < k and pos + run < len(agree) and agree[pos + run]:
            run += 1
        pos += run + 1  # the accepted drafts, then the check's own token
        cycles += 1
    return len(agree), cycles


def forward_cost(lm, widths: list[int], rounds: int = 7, context: int = 128) -> dict[int, float]:
    """CPU time of a forward of w new tokens on a `context`-token cache ÷ a one-token forward: the
    widths in turn each round (the fastest of 3 tries each, as a forward is ~50 ms and the machine is
    shared), the median over rounds."""
    from transformers import DynamicCache

    ids = torch.randint(100, 1000, (1, context + max(widths)))
    with torch.inference_mode():
        cache = DynamicCache(config=lm.model.config)
        lm.model(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)

        def once(w: int) -> float:
            t = time.process_time()
            lm.model(input_ids=ids[:, context:context + w], cache=cache, use_cache=True)
            spent = time.process_time() - t
            cache.crop(-w)  # back to the context: the same cache for every try
            return spent

        per = {w: [min(once(w) for _ in range(3)) for _ in range(1)] for w in widths}
        for _ in range(rounds - 1):
            for w in widths:
                per[w].append(min(once(w) for _ in range(3)))
    one = statistics.median(per[1])
    return {w: statistics.median(per[w]) / one for w in widths}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--layers", default="8,12,16,20,24,28")
    args = parser.parse_args()
    layers = [int(x) for x in args.layers.split(",")]
    lm = load_model("embedded", dtype="float32")
    n = lm.num_layers
    prompts = [e["prompt"] for e in json.loads((ROOT / "assets" / "examples.json").read_text())]
    per_prompt = [agreements(lm, p, args.tokens, layers) for p in prompts]
    cost = forward_cost(lm, sorted({1, *(k + 1 for k in DRAFTS)}))
    # A draft token's share of a forward, by weights (one token reads every weight once: its compute on
    # a CPU and its memory traffic on a GPU go with them): L decoder layers plus the output head.
    per_layer = sum(p.numel() for p in lm.layers[0].parameters())
    head = lm.model.get_output_embeddings().weight.numel()

    def share(layer: int) -> float:
        return (layer * per_layer + head) / (n * per_layer + head)
    print(f"{len(prompts)} prompts, greedy, up to {args.tokens} tokens each; the model has {n} layers; a draft "
          "token costs " + ", ".join(f"L{layer} {share(layer):.2f}" for layer in layers) + " of a forward")
    print("forward of w tokens ÷ one token (CPU time, cache of 128): "
          + ", ".join(f"w={w} {c:.2f}" for w, c in cost.items()))
    print(f"{'layer':>5} {'accept':>7}  " + "  ".join(f"k={k}: CPU ×  GPU ×" for k in DRAFTS))
    for layer in layers:
        agree = [a for p in per_prompt for a in p[layer]]
        cells = []
        for k in DRAFTS:
            made = cycles = 0
            for p in per_prompt:
                m, c = simulate(p[layer], k)
                made, cycles = made + m, cycles + c
            per_cycle = made / cycles
            draft = k * share(layer)  # k early-exit tokens: L layers and the output head each
            cpu = per_cycle / (draft + cost[k + 1])
            gpu = per_cycle / (draft + 1.0)  # memory-bound: checking k + 1 tokens ~ one forward
            cells.append(f"{cpu:9.2f} {gpu:6.2f}")
        print(f"{layer:5d} {sum(agree) / len(agree):7.1%}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
