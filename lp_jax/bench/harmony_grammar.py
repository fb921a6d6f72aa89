"""What GPT-OSS's framed output format costs on the host per token (issue #32).

    python -m lp_jax.bench.harmony_grammar [--tokenizer PATH | --train-bpe DIR] [--tokens N]

On a harmony model a chat request's format holds the whole answer (harmony.py
`final_channel_grammar`): an optional analysis message, then the final channel with the
format's text. So every token of the answer is constrained, the analysis's free text
too. This times the bitmask fill and the matcher advance of a JSON schema framed so,
beside the same schema alone, with bench/structured.py's walk (tokens drawn uniformly
from the allowed ones; the analysis then runs to its max_tokens / 2 budget, as a random
model's does). The tokenizer needs harmony's markers as special tokens: `--train-bpe`
trains bench/structured.py's 151,643-token BPE with them (GPT-OSS's own o200k_harmony is
not on the host and is not downloaded); `--tokenizer` takes any local tokenizer.json
that has them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lp_jax.bench import structured

MAX_TOKENS = 200  # the request's: the analysis may take about 100 of them


def train_bpe(out_dir: Path) -> Path:
    """bench/structured.py's byte-level BPE, with harmony's markers as its specials."""
    from checkpoints.make_tiny import HARMONY_TOKENS

    return structured.train_bpe(out_dir, special_tokens=HARMONY_TOKENS)


def main(argv=None):
    from tokenizers import Tokenizer

    from lp_jax.server.harmony import final_channel_grammar, harmony_tokens
    from lp_jax.structured.params import StructuredOutputsParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", help="a local tokenizer.json with harmony's markers")
    ap.add_argument("--train-bpe", help="train a 151,643-token BPE into this directory first")
    ap.add_argument("--tokens", type=int, default=2000, help="tokens walked per spec")
    ap.add_argument("--rows", type=int, default=32, help="rows of the batched fill")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.tokenizer is None and args.train_bpe is None:
        ap.error("give --tokenizer or --train-bpe")
    path = Path(args.tokenizer) if args.tokenizer else train_bpe(Path(args.train_bpe))
    tok = Tokenizer.from_file(str(path))
    marks = harmony_tokens(tok)
    if marks is None:
        ap.error(f"{path} does not have harmony's markers as special tokens")
    framed = final_channel_grammar(StructuredOutputsParams(json=structured.SCHEMA), MAX_TOKENS)
    specs = {"json_schema": {"json": structured.SCHEMA},
             "harmony json_schema": {"json": structured.SCHEMA, "frame": framed.frame}}
    vocab = -(-tok.get_vocab_size() // 128) * 128  # padded, as model embeddings are
    saved, structured.SPECS = structured.SPECS, specs
    try:
        out = structured.grammar_costs(path, vocab, [marks.ret, marks.call], args.tokens,
                                       args.rows)
    finally:
        structured.SPECS = saved
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
