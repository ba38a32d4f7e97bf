"""Sampling parameters and the engine's token sampler.

>>> s = ds4.Sampling(temperature=0.8, top_p=0.95, seed=1)
>>> sampler = s.sampler()                 # its own random stream, seeded once from s.seed
>>> token = sampler.sample(logits)        # logits: float32 [vocab]
>>> ids, probs = sampler.distribution(logits)   # exactly what sample() draws from

The distribution is defined once, in the engine (``rust/engine/sampling``): temperature
scaling of the logits, softmax (max-subtracted, in float64), then top-k, then top-p over
the top-k survivors renormalized (the smallest set, by decreasing probability, whose mass is
>= top_p), then min-p (drop p < min_p * p_max), then renormalization. Ties are broken towards
the lower token id throughout; temperature 0 is greedy (argmax, lowest id on ties).
"""

from __future__ import annotations

import dataclasses
import numbers
import secrets

import numpy as np
import numpy.typing as npt

from . import _ds4

__all__ = ["Sampler", "Sampling", "SamplerState"]

SamplerState = tuple[int, int, int, int]
"""A sampler's random-stream state, from :meth:`Sampler.snapshot`."""

_SEED_LIMIT = 1 << 64
#: top_k's bound (any value past the vocabulary keeps every token).
_TOP_K_LIMIT = 2**32


def _native(params: Sampling) -> _ds4.Sampler:
    assert params.seed is not None
    return _ds4.Sampler(
        float(params.temperature), int(params.top_k), float(params.top_p), float(params.min_p), int(params.seed)
    )


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to pick tokens from logits.

    ``temperature`` is finite and >= 0 (0 is greedy); ``top_k`` >= 0 (0 disables it);
    ``top_p`` in (0, 1] (1 disables it); ``min_p`` in [0, 1) (0 disables it). Invalid
    settings raise :class:`ValueError` naming the parameter and its range. ``seed`` None draws
    a random 64-bit seed once, at construction; it is stored in ``seed``, so after
    construction ``seed`` is always an int and the run can be reproduced from it.

    The engine computes in float32 parameters (as llama.cpp does): a value is rounded to the
    nearest float32 before use.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if int(self.top_k) >= _TOP_K_LIMIT:
            raise ValueError(f"top_k must be below 2**32 (any value past the vocabulary keeps every token), "
                             f"got {self.top_k!r}")
        if self.seed is None:
            object.__setattr__(self, "seed", secrets.randbits(64))
        elif (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, numbers.Integral)
            or not 0 <= int(self.seed) < _SEED_LIMIT
        ):
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name} must be a number, got {value!r}")
        # The engine's own validation, so the messages are the engine's.
        _native(self)

    @classmethod
    def greedy(cls) -> Sampling:
        """Greedy decoding: temperature 0, argmax with ties to the lowest id (seed 0: unused)."""
        return cls(temperature=0.0, seed=0)

    @property
    def is_greedy(self) -> bool:
        """Whether this is greedy decoding: a temperature of 0 as the engine reads it (a
        float32, so ``1e-50`` is greedy too)."""
        return float(np.float32(self.temperature)) == 0.0

    def sampler(self) -> Sampler:
        """A new sampler with these parameters; its random stream starts from ``seed``, so
        every sampler made from the same ``Sampling`` produces the same tokens."""
        return Sampler(self)


def _logits_bytes(logits: npt.ArrayLike) -> bytes:
    a = np.asarray(logits)
    if a.ndim != 1:
        raise ValueError(f"logits must be one-dimensional (one row of the vocabulary), got shape {a.shape}")
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


class Sampler:
    """Samples token ids with fixed :class:`Sampling` parameters and a persistent random
    stream: seeded once, never reseeded; :meth:`snapshot` / :meth:`restore` save and rewind it.
    """

    def __init__(self, params: Sampling) -> None:
        self.params = params
        self._native = _native(params)

    def sample(self, logits: npt.ArrayLike) -> int:
        """One token id from the filtered distribution of ``logits`` (float32 [vocab]).
        Draws one random number, none at temperature 0."""
        return self._native.sample(_logits_bytes(logits))

    def distribution(self, logits: npt.ArrayLike) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
        """The distribution :meth:`sample` draws from: (ids, probabilities), the ids of
        positive probability in increasing order. Greedy gives one id with probability 1."""
        ids, probs = self._native.distribution(_logits_bytes(logits))
        return np.asarray(ids, dtype=np.int64), np.asarray(probs, dtype=np.float64)

    def snapshot(self) -> SamplerState:
        """The random stream's state."""
        return self._native.snapshot()

    def restore(self, state: SamplerState) -> None:
        """Rewinds (or forwards) the random stream to ``state`` from :meth:`snapshot`."""
        self._native.restore(state)

    def __repr__(self) -> str:
        return f"Sampler({self.params!r})"
