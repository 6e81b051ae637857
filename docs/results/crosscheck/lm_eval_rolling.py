"""Cross-check of our baseline perplexity numbers against lm-evaluation-harness.

For a few texts, the total NLL (nats) of each document is computed three ways and compared:
  ours         feedback.eval.perplexity.token_nlls, baseline only, one window covering the document
  independent  plain transformers written here (no feedback import): one forward, log_softmax, gather
  lm-eval      lm_eval's HFLM(pretrained=<model folder>).loglikelihood_rolling, matched to our convention

Our convention (feedback.eval.perplexity.scoring_convention): each document tokenised on its own with the
tokenizer's default special tokens (no BOS for the embedded model), the first token NOT scored, every
later token scored once given all the tokens before it (inside one window), natural log.

lm-eval's loglikelihood_rolling instead scores EVERY token of the string: it feeds
[prefix_token] + tokens[:-1] and scores tokens, the prefix being `prefix_token_id` (default: the
tokenizer's BOS, here <|im_start|>, else EOS). Subtracting the first token's NLL afterwards is not
enough: the prefix token stays in the context of every later token too, which shifts all of their
NLLs. So the match is exact instead: the document's own first token is made lm-eval's prefix
(prefix_token_id = ids[0]) and lm-eval is given the string of the remaining tokens ids[1:] (checked
to re-tokenise to exactly ids[1:]). lm-eval then feeds ids[:-1] and scores ids[1:] — our convention.
Out of the box lm-eval's number is also printed, split into its two extra parts, for information.

Sliding windows: lm-eval's rolling windows with max_length=L (disjoint prediction spans, each
window L tokens of input; the last one full length) are our windows with window=L+1, stride=L; the
last row checks that on a document longer than one window.

Run from a separate virtualenv holding lm-eval (see README, "Cross-check with lm-evaluation-harness"):
    PYTHONPATH=. /tmp/lmeval-venv/bin/python docs/results/crosscheck/lm_eval_rolling.py   (from the repo root)
Exits 1 if any two of the three numbers for a document differ by more than --tol nats (1e-3 by
default; float32 rounding across attention kernels (eager vs SDPA) and chunking measured <= 1.1e-4
nats per 256-token document).
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never wait on the hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

FIXED_TEXT = "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun."


# ---- (b) independent implementation: plain transformers, nothing from feedback ----------------------

def independent_total(model, ids: list[int], window: int | None = None) -> float:
    """Total NLL (nats) of ids[1:] given the tokens before each. With `window` = L, targets are
    scored in consecutive spans of L, each span's forward taking the L+1 tokens ending at its last
    target (the first span starts at token 0): lm-eval's rolling windows, written out directly."""
    spans = [(1, len(ids))] if window is None else [
        (s, min(s + window, len(ids))) for s in range(1, len(ids), window)]
    total = 0.0
    with torch.inference_mode():
        for first, end in spans:  # targets ids[first:end]
            start = 0 if window is None else max(0, end - window - 1)
            x = torch.tensor(ids[start:end])[None]
            logp = torch.log_softmax(model(input_ids=x).logits[0].float(), dim=-1)
            k = end - first  # the last k logits before the end predict the k targets
            pos = torch.arange(x.shape[1] - 1 - k, x.shape[1] - 1)
            total += float(-logp[pos, torch.tensor(ids[first:end])].double().sum())
    return total


def first_token_nll(model, ids: list[int], prefix: int) -> float:
    with torch.inference_mode():
        logp = torch.log_softmax(model(input_ids=torch.tensor([[prefix]])).logits[0, -1].float(), dim=-1)
    return float(-logp[ids[0]])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=3, help="documents of builtin:test (default 3)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per document (default 256)")
    ap.add_argument("--window", type=int, default=64,
                    help="lm-eval max_length L for the sliding-window row (ours: window L+1, stride L)")
    ap.add_argument("--tol", type=float, default=1e-3, help="nats per document total (default 1e-3)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import lm_eval
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM

    from feedback.core.model import load_model
    from feedback.eval.corpus import Document, load
    from feedback.eval.perplexity import PPLConfig, scoring_convention, token_nlls

    # (a) ours: the embedded model as the app loads it (float32; eager attention on CPU)
    lm = load_model("embedded", dtype="float32", device="cpu")
    folder = lm.model.name_or_path  # the converted HF folder (feedback.core.embedded.prepare())
    tok = lm.tokenizer
    conv = scoring_convention(lm, PPLConfig())
    assert not conv["bos_added"] and not conv["first_token_scored"], conv

    docs = load("builtin:test")[: args.docs] + [Document("fixed-string", FIXED_TEXT)]
    rows = []  # (name, ids, our PPLConfig, lm-eval max_length or None)
    for doc in docs:
        ids = tok(doc.text)["input_ids"][: args.tokens]  # = feedback.eval.perplexity.document_ids
        rows.append((doc.name, ids, PPLConfig(window=len(ids), stride=len(ids)), None))
    long_doc = load("builtin:test")[args.docs]
    ids = tok(long_doc.text)["input_ids"][: args.tokens]
    rows.append((f"{long_doc.name} (windows)", ids, PPLConfig(window=args.window + 1, stride=args.window),
                 args.window))

    # (b) the same folder through plain transformers, default attention kernel (SDPA)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    # (c) lm-eval's HF wrapper on the same folder; batch_size 1 so no padding enters
    hflm = HFLM(pretrained=folder, device="cpu", dtype="float32", batch_size=1)
    default_prefix = hflm.prefix_token_id
    default_max_length = hflm.max_length

    def configure(prefix: int | None, max_length: int | None) -> None:
        # the attributes that HFLM's prefix_token_id= and max_length= arguments set (None: default)
        hflm.custom_prefix_token_id = prefix
        hflm._max_length = max_length

    def rolling(text: str, prefix: int | None, max_length: int | None) -> float:
        configure(prefix, max_length)
        req = Instance("loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
        return -hflm.loglikelihood_rolling([req], disable_tqdm=True)[0]

    print(f"model folder: {folder}")
    print(f"torch {torch.__version__}, transformers {__import__('transformers').__version__}, "
          f"lm_eval {lm_eval.__version__}; threads {args.threads}")
    print("our convention: " + ", ".join(f"{k} {conv[k]}" for k in ("bos_added", "special_tokens",
                                                                     "first_token_scored"))
          + f"; one window covering each document, except the last row: window {args.window + 1}, "
            f"stride {args.window}")
    print(f"lm-eval defaults: prefix_token_id {default_prefix} ({tok.decode([default_prefix])!r}), "
          f"max_length {default_max_length}, every token of the string scored")
    print("lm-eval as run: prefix_token_id = the document's first token, string = the text of the "
          "tokens after it\n")

    head = f"{'doc':<28} {'tokens':>6} {'ours':>12} {'independent':>12} {'lm-eval':>12} {'max|diff|':>10}"
    print(head)
    print("-" * len(head))
    worst, info = 0.0, []
    for name, ids, cfg, max_length in rows:
        ours = float(token_nlls(lm, ids, cfg.validate(lm.context_length))[0].sum())
        indep = independent_total(ref, ids, max_length)
        rest = tok.decode(ids[1:])
        configure(ids[0], max_length)
        if hflm.tok_encode(rest) != ids[1:]:
            print(f"{name}: the text after the first token does not re-tokenise to the same ids; "
                  f"choose another --tokens", file=sys.stderr)
            return 2
        lme = rolling(rest, ids[0], max_length)
        diff = max(ours, indep, lme) - min(ours, indep, lme)
        worst = max(worst, diff)
        print(f"{name:<28} {len(ids):>6} {ours:>12.5f} {indep:>12.5f} {lme:>12.5f} {diff:>10.2e}")
        if max_length is None:
            out_of_box = rolling(tok.decode(ids), None, None)
            first = first_token_nll(ref, ids, default_prefix)
            info.append((name, out_of_box, out_of_box - ours, first, out_of_box - ours - first))

    print(f"\nscored tokens per document = tokens - 1; totals in nats; tolerance {args.tol:g} nats")
    print(f"largest disagreement: {worst:.2e} nats -> {'AGREE' if worst <= args.tol else 'DISAGREE'}")

    print(f"\nFor information, lm-eval out of the box (prefix {tok.decode([default_prefix])!r} before the "
          f"document, every token scored):")
    head2 = f"{'doc':<28} {'lm-eval':>12} {'- ours':>10} {'first token':>12} {'context shift':>14}"
    print(head2)
    print("-" * len(head2))
    for name, total, extra, first, shift in info:
        print(f"{name:<28} {total:>12.5f} {extra:>10.5f} {first:>12.5f} {shift:>14.5f}")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
