"""FlowMatchTable: the flow-matching schedule of few-step causal Wan models (Self-Forcing, CausVid).

A table of `num_train_timesteps` sigmas, `sigma = shift*s / (1 + (shift-1)*s)` over s = linspace(1, 0, N+1)[:-1],
with timesteps = N * sigma. A timestep's sigma is the table entry whose timestep is nearest (not t / N). The
model predicts the flow v; x0 = x_t - sigma * v (in float64); re-noising to the next step's timestep is
x = (1 - sigma) * x0 + sigma * eps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class FlowMatchTable:
    def __init__(self, shift: float = 5.0, num_train_timesteps: int = 1000):
        self.shift = shift
        self.num_train_timesteps = num_train_timesteps
        s = torch.linspace(1.0, 0.0, num_train_timesteps + 1)[:-1]
        self.sigmas = shift * s / (1 + (shift - 1) * s)
        self.timesteps = self.sigmas * num_train_timesteps
        self._values: dict[float, float] = {}  # timestep -> sigma (the float32 table entry), see sigma_value

    def step_list(self, steps: Sequence[float], warp: bool) -> torch.Tensor:
        """The denoising timesteps; with `warp`, step t becomes the table timestep at index N - t (so the
        nominal list [1000, 750, 500, 250] follows the shifted schedule: [1000, 937.5, 833.3, 625])."""
        steps = torch.tensor(list(steps), dtype=torch.float32)
        if not warp:
            return steps
        table = torch.cat([self.timesteps, torch.zeros(1)])
        index = (self.num_train_timesteps - steps).long()
        if (index < 0).any() or (index > self.num_train_timesteps).any():
            raise ValueError(f"denoising steps must lie in [0, {self.num_train_timesteps}], got {steps.tolist()}")
        return table[index]

    def sigma(self, timestep: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The sigma of each timestep: the entry of the table whose timestep is nearest."""
        timestep = torch.as_tensor(timestep, dtype=torch.float64).reshape(-1)
        index = torch.argmin((self.timesteps.double()[None, :] - timestep[:, None].cpu()).abs(), dim=1)
        return self.sigmas.to(dtype)[index]

    def sigma_value(self, timestep: float) -> float:
        """`sigma(timestep)` as a Python float, looked up once per timestep (a stream asks for the same few timesteps
        at every block: no tensor work on the host per step)."""
        key = float(timestep)
        value = self._values.get(key)
        if value is None:
            value = self._values[key] = self.sigma(torch.tensor([key])).item()  # as the float32 tensor it was
        return value

    def to_x0(self, flow: torch.Tensor, x_t: torch.Tensor, timestep: float) -> torch.Tensor:
        """x0 = x_t - sigma(t) * v, computed in float64, returned in the dtype of `flow`."""
        sigma = self.sigma_value(timestep)
        return (x_t.double() - sigma * flow.double()).to(flow.dtype)

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, timestep: float) -> torch.Tensor:
        """(1 - sigma(t)) * x0 + sigma(t) * noise, in the dtype of `noise`."""
        sigma = self.sigma_value(timestep)
        return ((1 - sigma) * x0 + sigma * noise).to(noise.dtype)
