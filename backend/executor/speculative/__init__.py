"""Speculative decoding with a DSpark draft, the one package the worker's model runner calls: the decoder
(`decoder.py`: draft, Markov, target-verify, acceptance and draft-cache phases) and its CUDA graphs (`graphs.py`),
the draft's paged context cache, the proposer, the verification rules and the confidence-based verify length.
The engine's side (which sequences draft, the counters) is `engine/speculative_scheduling.py` and
`engine/speculative_metrics.py`; the options are `speculative_config.py`."""
