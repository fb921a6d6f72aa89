"""Structured outputs: JSON schemas, regexes, choices and grammars, enforced token by token.

    request's StructuredOutputsParams (params.py)
      -> GrammarCompiler.compile: llguidance grammar, compiled once per spec (compiler.py)
      -> one matcher per constrained sequence, advanced with each committed token
      -> fill: the bitmask rows of a step's constrained samples (matchers.py)
      -> the step masks those rows' logits on device (executor/sampler.apply_bitmask)

The grammar engine is llguidance: it needs nothing else (no torch, transformers or
triton, which xgrammar requires) and builds its token trie from the model's own
tokenizer.json. The mask is an [S, ceil(V/32)] int32 input of every step program, all
ones for rows without a grammar, so structured outputs add no program.
"""

from lp_jax.structured.params import StructuredOutputsParams, mask_words

# compiler.py and matchers.py (llguidance) are imported by path, where a grammar is used.
__all__ = ["StructuredOutputsParams", "mask_words"]
