"""Parallel inference: one request spread over several processes (torchrun's, or `num_gpus` workers).

`state`: the layout (ulysses x ring x tp x cfg = world size), process groups, the rank's device, rank-0 rules;
`sequence`: sequence parallelism for a video DiT (frame-wise token split; Ulysses, ring or USP attention);
`ulysses`: the all-to-all from sequence shards to head shards and back;
`ring`: ring attention (K/V shards passed around the ranks, partial outputs merged in fp32 by log-sum-exp);
`tensor`: tensor parallelism (attention heads and FFN hidden units split over the ranks, weights loaded as slices);
`cfg`: the two guidance branches on two rank groups;
`workers`: `VideoGenerator.from_pretrained(..., num_gpus=N)`'s worker processes.
Model code does not import this package: the parallel hook (composer/accel/parallel.py) fills a model's block
runner from its declared `token_plan` (composer/models/runner.py) and sets its attention modules' `parallel`, and
a model states what tensor parallelism splits as data (`tensor_parallel_plan`).
"""
