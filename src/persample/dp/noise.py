"""The Gaussian noise of a DP-SGD step, drawn into the gradient's own memory.

Drawing ``P`` normal numbers is the one cost of a DP step that a plain SGD step
does not have (a 50x300 MLP: 4.5 M parameters, 12 ms for ``normal_`` on one
CPU thread against 22 ms for the whole plain step). The noise of one release is a
function of one seed: each release takes one 62-bit seed from the caller's
``torch.Generator``, and the noise of parameter ``j`` (its flattened entries, in
blocks of :data:`BLOCK`) comes block by block from generators seeded by ``(seed, j,
block)``. So any part of the noise can be drawn alone: a process of a sharded model
draws the blocks of its own shard only, and the whole noise is the same for one
process or any number of them (the same seed gives the same ``p.grad``). On the CPU
the blocks are drawn in parallel (``torch``'s CPU ``normal_`` runs on one thread), shared
out among torch's threads by size in a pool kept for the process.
The buffer comes from persample's result memory (:mod:`persample.memory`), so the
``p.grad`` of one step reuses the pages of the step before instead of faulting
fresh ones. :func:`add_gaussian` adds the same numbers to tensors that exist already
(a step's clipped sums), one block at a time, so that no second buffer of their size
is needed.

Source: the counter-based streams of Salmon et al. 2011 ("Parallel random numbers:
as easy as 1, 2, 3"), here with one seeded generator per block.

``secure_mode`` (:class:`SecureSource` in place of the generator) draws the noise from
the operating system's cryptographically secure generator instead
(:func:`secure_normal`): nothing about it can be predicted from a seed or from
earlier draws, at the cost of reproducibility and speed.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor, nn

from ..memory import result_empty
from ..precision import accumulate_dtype

PARALLEL_MIN = 1 << 20  # numbers: smaller draws stay on one thread
BLOCK = 1 << 20  # numbers of one parameter drawn from one seeded generator


class SecureSource:
    """The noise source of ``secure_mode=True``, given where a ``torch.Generator`` goes:
    the operating system's cryptographically secure random bytes (``os.urandom``: Linux's
    ``getrandom``, a ChaCha20 stream reseeded from hardware entropy), turned into
    Gaussian numbers by the Box-Muller transform in float64 (:func:`secure_normal`).

    Threat model: an adversary who sees the trained model (or every noised gradient),
    knows the code, and could learn or guess a seed. A seeded ``torch.Generator``
    (Mersenne Twister on CPUs, Philox on GPUs) is then no protection: from its seed, or
    from enough of its outputs, the noise can be computed and subtracted. The OS's
    generator has no seed to learn and its outputs do not reveal the next ones. Not
    covered: an adversary with access to the training process's memory, and the
    floating-point attacks on the noise's low-order bits (Mironov 2012; Jin et al.
    2022), which Box-Muller in float64 (52 random bits per uniform) makes harder but
    does not rule out. Cost: 18 to 24 ns per number on this project's 2-core CPU in
    ``persample bench`` (``os.urandom`` on one thread, the kernel's generator, is most
    of it), against 2.5 ns for a seeded ``normal_``: a 4.5 M-parameter step draws its
    noise in 82 against 11 to 13 ms; plus a copy to the parameters' device. The run
    cannot be reproduced from a seed.

    Examples:
        >>> from persample.dp.noise import SecureSource, gaussian_like
        >>> ps = [torch.nn.Parameter(torch.zeros(1000))]
        >>> (noise,) = gaussian_like(ps, 2.0, SecureSource())
        >>> 1.8 < float(noise.std()) < 2.2
        True
    """

    def __repr__(self) -> str:
        return "SecureSource()"


def noise_source(generator: torch.Generator | None, secure_mode: bool
                 ) -> torch.Generator | SecureSource | None:
    """What a step draws its noise from: ``generator``, or with ``secure_mode`` a
    :class:`SecureSource`.

    Raises:
        ValueError: both a generator and ``secure_mode``; a ``secure_mode`` that is not a
            bool.

    Examples:
        >>> noise_source(None, True)
        SecureSource()
    """
    if not isinstance(secure_mode, bool):
        raise ValueError(f"secure_mode must be True or False, got {secure_mode!r}")
    if not secure_mode:
        return generator
    if generator is not None:
        raise ValueError(
            "secure_mode=True draws the noise from the operating system's secure generator, "
            "which has no seed; a generator would make it reproducible, and predictable to "
            "whoever learns the seed: pass one or the other")
    return SecureSource()


def secure_uniform(numel: int) -> Tensor:
    """``(numel,)`` float64 uniforms in ``(0, 1]`` of 52 random bits each, from
    ``os.urandom`` (the operating system's cryptographically secure generator).

    Examples:
        >>> u = secure_uniform(1000)
        >>> u.dtype, bool(((u > 0) & (u <= 1)).all())
        (torch.float64, True)
    """
    if numel == 0:
        return torch.zeros(0, dtype=torch.float64)
    raw = torch.frombuffer(bytearray(os.urandom(8 * numel)), dtype=torch.int64)
    ones = ((raw >> 12) & ((1 << 52) - 1)) | 0x3FF0000000000000  # float64 bits in [1, 2)
    return torch.sub(2.0, ones.view(torch.float64))


def secure_normal(numel: int, std: float, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> Tensor:
    """``numel`` numbers ``N(0, std^2)`` from the OS's cryptographically secure generator
    (:class:`SecureSource`): uniforms of 52 random bits from ``os.urandom``, paired by
    the Box-Muller transform (Box & Muller 1958) in float64, then cast.

    Args:
        numel: how many numbers, ``>= 0``.
        std: the standard deviation, ``>= 0``.
        dtype, device: of the result (drawn on the CPU, then copied).

    Returns:
        A 1-d tensor of ``numel`` numbers.

    Examples:
        >>> z = secure_normal(100_000, 1.0, torch.float64)
        >>> abs(float(z.mean())) < 0.02 and 0.98 < float(z.std()) < 1.02
        True
    """
    half = (numel + 1) // 2
    u = secure_uniform(2 * half)  # (2 half,)
    radius = torch.sqrt(-2.0 * torch.log(u[:half])).mul_(std)  # (half,)
    angle = u[half:].mul_(2.0 * math.pi)
    z = torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:numel]
    return z.to(dtype=dtype, device=device)


def _secure_fill(out: Tensor, std: float, add: bool = False) -> None:
    """``out`` (1-d) filled with (``add``: added to) secure noise, a block at a time."""
    for start in range(0, out.numel(), BLOCK):
        part = out[start:start + BLOCK]
        drawn = secure_normal(part.numel(), std, part.dtype, part.device)
        part.add_(drawn) if add else part.copy_(drawn)


def gaussian_like(params: list[nn.Parameter], std: float,
                  generator: torch.Generator | None, blocks: list[Tensor] | None = None,
                  accumulate: bool = False) -> list[Tensor]:
    """One noise tensor per parameter, ``N(0, std^2)`` entries, views of one buffer per
    dtype and device.

    Args:
        params: the tensors to draw for; each result has its shape, dtype and device.
        std: the standard deviation (``sigma * C`` for DP-SGD), ``>= 0``; 0 draws too
            (the generator advances alike).
        generator: the caller's ``torch.Generator`` on the parameters' device, ``None``
            for torch's default one, or a :class:`SecureSource` (``secure_mode``).
        blocks: if given, the 1-d blocks the tensors view are appended to it.
        accumulate: draw in the dtype sums accumulate in (float32 for bfloat16 and
            float16 parameters: :func:`persample.precision.accumulate_dtype`).

    Returns:
        A list of tensors in ``params`` order, contiguous, the caller's to keep (e.g. as
        ``p.grad``).

    Raises:
        RuntimeError: a generator on another device than a parameter (from torch).

    Examples:
        >>> ps = [nn.Parameter(torch.zeros(3, 2)), nn.Parameter(torch.zeros(4))]
        >>> [t.shape for t in gaussian_like(ps, 1.0, torch.Generator().manual_seed(0))]
        [torch.Size([3, 2]), torch.Size([4])]
    """
    out = pooled_like(params, None, blocks, accumulate)
    fill_gaussian(out, std, generator)
    return out


def fill_gaussian(tensors: list[Tensor], std: float,
                  generator: torch.Generator | SecureSource | None) -> None:
    """Fill each tensor, in place, with the noise :func:`gaussian_like` draws for tensors
    of its shape, dtype and device from the same generator state (one seed): the same
    numbers, in memory the caller holds (a correlated mechanism's ring).

    Raises:
        RuntimeError: a non-contiguous tensor (from torch's ``view``).

    Examples:
        >>> out = [torch.empty(3, 2), torch.empty(4)]
        >>> fill_gaussian(out, 0.5, torch.Generator().manual_seed(0))
        >>> drawn = gaussian_like(out, 0.5, torch.Generator().manual_seed(0))
        >>> all(torch.equal(a, b) for a, b in zip(out, drawn))
        True
    """
    if isinstance(generator, SecureSource):
        for t in tensors:
            _secure_fill(t.view(-1), std)
        return
    seed = release_seed(generator)
    _in_parallel([(t.view(-1), std, seed, j, 0, t.numel()) for j, t in enumerate(tensors)])


def add_gaussian(tensors: list[Tensor], std: float, generator: torch.Generator | None
                 ) -> None:
    """Add to each tensor, in place, the noise :func:`gaussian_like` draws for tensors of
    its shape, dtype and device from the same generator state: the same numbers, without
    a second tensor of their size (each block of at most :data:`BLOCK` numbers is drawn
    into a temporary and added).

    Args:
        tensors: contiguous floating-point tensors (e.g. clipped sums ``(*p.shape)`` in
            the dtype they accumulate in), in the order of the parameters they stand for;
            modified in place.
        std: the standard deviation (``sigma * C``), ``>= 0``.
        generator: as for :func:`gaussian_like` (it advances alike: one seed).

    Raises:
        RuntimeError: a non-contiguous tensor, or a generator on another device (from
            torch).

    Examples:
        >>> sums = [torch.ones(3, 2), torch.zeros(4)]
        >>> drawn = gaussian_like(sums, 0.5, torch.Generator().manual_seed(0))
        >>> add_gaussian(sums, 0.5, torch.Generator().manual_seed(0))
        >>> torch.equal(sums[0], 1 + drawn[0]), torch.equal(sums[1], drawn[1])
        (True, True)
    """
    if isinstance(generator, SecureSource):
        for t in tensors:
            _secure_fill(t.view(-1), std, add=True)
        return
    seed = release_seed(generator)
    _in_parallel([(t.view(-1), std, seed, j, 0, t.numel()) for j, t in enumerate(tensors)],
                 add=True)


def release_seed(generator: torch.Generator | None) -> int:
    """The one seed of a release, taken from ``generator``: one draw, so the generator
    advances alike whatever the number of parameters.

    Args:
        generator: a ``torch.Generator`` (any device), or ``None`` for torch's default
            generator of the CPU.

    Returns:
        A seed in ``[0, 2^62)``.

    Examples:
        >>> a = release_seed(torch.Generator().manual_seed(0))
        >>> a == release_seed(torch.Generator().manual_seed(0)), 0 <= a < 2**62
        (True, True)
    """
    return int(torch.randint(0, 2**62, (1,), generator=generator,
                             device=generator.device if generator is not None else "cpu"))


def noise_range(out: Tensor, std: float, seed: int, index: int, start: int, numel: int
                ) -> None:
    """Fill ``out`` with a part of one parameter's noise of a release: the part a shard
    of that parameter holds.

    Args:
        out: 1-d, entries ``start .. start + out.numel()`` of the flattened noise.
        std: the standard deviation, ``>= 0``.
        seed: the release's seed (:func:`release_seed`).
        index: the parameter's position in the step's parameters.
        start: the first entry, ``0 <= start <= numel - out.numel()``.
        numel: the parameter's number of entries.

    Examples:
        >>> whole = torch.empty(10)
        >>> noise_range(whole, 1.0, 7, 0, 0, 10)
        >>> part = torch.empty(4)
        >>> noise_range(part, 1.0, 7, 0, 3, 10)
        >>> torch.equal(part, whole[3:7])
        True
    """
    _in_parallel([(out, std, seed, index, start, numel)])


def _in_parallel(jobs: list[tuple[Tensor, float, int, int, int, int]], add: bool = False
                 ) -> None:
    """Draw (``add``: add) the blocks of every job, in parallel on the CPU: the blocks
    shared out among torch's threads, largest first to the least loaded (each thread
    then draws its share in one task)."""
    pieces = [piece for job in jobs for piece in _pieces(*job)]
    total = sum(piece[0].numel() for piece in pieces)
    threads = min(torch.get_num_threads(), len(pieces))
    cpu = all(piece[0].device.type == "cpu" for piece in pieces)
    if threads < 2 or total < PARALLEL_MIN or not cpu:
        for piece in pieces:
            _draw_piece(*piece, add=add)
        return
    shares: list[list[tuple]] = [[] for _ in range(threads)]
    loads = [0] * threads
    for piece in sorted(pieces, key=lambda piece: -piece[0].numel()):
        k = loads.index(min(loads))
        shares[k].append(piece)
        loads[k] += piece[0].numel()
    list(_pool(threads).map(lambda share: [_draw_piece(*p, add=add) for p in share], shares))


_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}


def _pool(threads: int) -> ThreadPoolExecutor:
    """A pool of ``threads`` threads kept for the process's later draws (one made per
    step cost about a tenth of a 4.5 M-number draw); a forked child makes its own."""
    key = (os.getpid(), threads)
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = ThreadPoolExecutor(threads, thread_name_prefix="persample-noise")
    return pool


def _pieces(out: Tensor, std: float, seed: int, index: int, start: int, numel: int
            ) -> list[tuple]:
    """The blocks ``out`` (entries ``start ..`` of parameter ``index`` of ``numel``)
    overlaps: ``(part of out, std, block seed, offset in the block, block length)``."""
    if start == 0 and out.numel() == numel <= BLOCK:  # (one whole block: no slice)
        return [(out, std, _mix(seed, index, 0), 0, numel)]
    found, done = [], 0
    while done < out.numel():
        block, offset = divmod(start + done, BLOCK)
        length = min(BLOCK, numel - block * BLOCK)
        size = min(length - offset, out.numel() - done)
        found.append((out[done : done + size], std, _mix(seed, index, block), offset, length))
        done += size
    return found


_GENERATORS = threading.local()


def _seeded(device: torch.device, seed: int) -> torch.Generator:
    """A generator of ``device`` in the state ``manual_seed(seed)`` gives a new one: one
    kept per thread and device, seeded again (making a CUDA generator costs several
    times the launch of the draw it seeds)."""
    kept = getattr(_GENERATORS, "by_device", None)
    if kept is None:
        kept = _GENERATORS.by_device = {}
    gen = kept.get(device)
    if gen is None:
        gen = kept[device] = torch.Generator(device=device)
    return gen.manual_seed(seed)


def _draw_piece(out: Tensor, std: float, seed: int, offset: int, length: int,
                add: bool = False) -> None:
    """Entries ``offset ..`` of a block of ``length`` numbers into ``out`` (``add``: added
    to it): a part of a block is cut from the whole block drawn (``normal_`` draws in
    groups whose values depend on the length drawn)."""
    gen = _seeded(out.device, seed)
    if offset == 0 and out.numel() == length and not add:
        out.normal_(0.0, std, generator=gen)
        return
    block = torch.empty(length, dtype=out.dtype, device=out.device)
    drawn = block.normal_(0.0, std, generator=gen)[offset : offset + out.numel()]
    if add:
        out.add_(drawn)
    else:
        out.copy_(drawn)


def _mix(seed: int, index: int, block: int) -> int:
    """A 62-bit seed for block ``block`` of parameter ``index`` (splitmix64 steps)."""
    x = seed & (2**64 - 1)
    for part in (index, block):
        x = (x ^ part) * 0x9E3779B97F4A7C15 & (2**64 - 1)
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & (2**64 - 1)
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & (2**64 - 1)
        x ^= x >> 31
    return x >> 2


def pooled_like(params: list[nn.Parameter], fill: Callable[[Tensor], Any] | None = None,
                blocks: list[Tensor] | None = None, accumulate: bool = False) -> list[Tensor]:
    """One tensor per parameter (its shape, dtype and device), views of one block of
    persample's result memory per dtype and device (:mod:`persample.memory`).

    Args:
        params: the tensors to make memory for.
        fill: initialises each 1-d block (e.g. ``lambda b: b.zero_()``); ``None``: left
            uninitialised.
        blocks: if given, the 1-d blocks are appended to it (to reduce them in one
            collective each).
        accumulate: in the dtype sums accumulate in (float32 for bfloat16 and float16).

    Returns:
        A list of contiguous tensors in ``params`` order.

    Examples:
        >>> ps = [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))]
        >>> [t.tolist() for t in pooled_like(ps, lambda b: b.zero_())]
        [[0.0, 0.0], [0.0, 0.0, 0.0]]
    """
    out: list[Tensor | None] = [None] * len(params)
    kinds = [(accumulate_dtype(p.dtype) if accumulate else p.dtype, p.device) for p in params]
    for kind in dict.fromkeys(kinds):
        picked = [k for k in range(len(params)) if kinds[k] == kind]
        buf = result_empty(sum(params[k].numel() for k in picked), *kind)
        if fill is not None:
            fill(buf)
        if blocks is not None:
            blocks.append(buf)
        parts = buf.split([params[k].numel() for k in picked])  # (one op for all)
        for k, part in zip(picked, parts):
            out[k] = part.view(params[k].shape)
    return out


def generate_noise(std: float, reference: Tensor, generator: torch.Generator | None = None,
                   secure_mode: bool = False) -> Tensor:
    """``N(0, std^2)`` noise of ``reference``'s shape, dtype and device, as Opacus's
    optimizer draws it for one parameter (its ``_generate_noise``).

    Args:
        std: the standard deviation (``sigma * C`` for DP-SGD), ``>= 0``.
        reference: a floating-point tensor: the result's shape, dtype and device.
        generator: a ``torch.Generator`` on ``reference``'s device, or ``None`` for
            torch's default one.
        secure_mode: draw from the operating system's secure generator
            (:class:`SecureSource`) instead.

    Returns:
        A new tensor like ``reference``.

    Raises:
        ValueError: ``std < 0``, or a generator with ``secure_mode``.

    Examples:
        >>> noise = generate_noise(2.0, torch.zeros(10_000),
        ...                        generator=torch.Generator().manual_seed(0))
        >>> noise.shape, round(noise.std().item(), 1)
        (torch.Size([10000]), 2.0)

    Source: Abadi et al. 2016 (the Gaussian mechanism of DP-SGD); Opacus (Yousefpour et
    al. 2021).
    """
    if not std >= 0:
        raise ValueError(f"std must be >= 0, got {std}")
    return gaussian_like([reference], std, noise_source(generator, secure_mode))[0]
