"""Decoding on device: sampling, autoregressive decoding, and the speculative loop
(draft -> tree -> verify -> accept -> commit), its adaptive budget and streamed chunks."""
