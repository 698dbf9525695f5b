"""Speculative decoding: cheap drafts verified by one target forward.

speculator.py (which requests draft, stats), ngram.py (prompt-lookup drafts), verify.py
(greedy and rejection-sampling verdicts), counters live in engine/core/spec_stats.py."""
