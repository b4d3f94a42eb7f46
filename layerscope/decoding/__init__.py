"""Decoding: lossless speculative decoding (`specdec`), the benchmark (`bench`) and the cost model that plans it (`costmodel`)."""
