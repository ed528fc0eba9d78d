"""Parallel primitives: building blocks that spread one model's work over several devices.

`ulysses`: sequence parallelism around attention (all-to-all from sequence shards to head shards and back);
`ring`: ring attention (K/V shards passed around the ranks, partial outputs merged in fp32 by log-sum-exp);
`tensor`: tensor parallelism (attention heads and FFN hidden units split over the ranks, weights loaded as slices).
Model code does not import this package; the pipeline wraps its attention modules with these primitives, and a
model states what tensor parallelism splits as data (`tensor_parallel_plan`).
"""
