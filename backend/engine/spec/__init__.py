"""Speculative decoding with a DSpark draft: the draft's paged context cache, the proposer step, the
verification rules and the confidence-based verify length. Engine-independent tensor functions."""
