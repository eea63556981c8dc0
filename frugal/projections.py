"""How the state-full subspace is chosen.

Every selection is a pure function of ``(seed, window, parameter identity)`` drawn from a local
``torch.Generator`` (the global RNG is never touched): data-parallel ranks and resumed runs pick the
same subspace without communication. Three kinds of projection:

* ``block``: whole tensors are state-full or state-free; nothing is projected.
* coordinate (``column``, ``row``, ``randk``, ``randperm``): coordinates along one dimension (or of
  the flattened tensor: ``randk``); projecting is a gather, lifting a scatter, the state reduced.
* matrix (``svd``, ``random``, ``power``): ``Q`` (``s x r``, orthonormal columns) on the smaller side
  ``s`` of the logical ``m x n`` weight (GaLore's ``std``): ``G @ Q`` for ``m >= n``, else ``Q^T @ G``.
  ``power`` starts from the SVD and is tracked by ``frugal.state_management``.

SVD bases have a fixed sign per column (largest-magnitude entry positive), so methods that keep
moments across a change of basis do not depend on the backend's sign choice. Every matrix-projection
computation runs inside ``full_fp32()`` (no TF32/bf16 matmuls whatever the global settings, as on the
authors' torch 2.1). "Logical" orientation: with ``transposed=True`` (GPT-2 ``Conv1D``, stored
``(in, out)``) the weight is read as its transpose, so ``column`` is an input feature.
"""
from __future__ import annotations

import contextlib
import math

import torch

BLOCK_ORDERS = ("ascending", "descending", "random", "mirror")
COORDINATE = ("column", "row", "randk", "randperm")
MATRIX = ("svd", "random", "power")
PROJECTIONS = ("block",) + COORDINATE + MATRIX

_MASK64 = (1 << 64) - 1


def _switches() -> list[tuple]:
    """(read, write, full precision) of each setting that may lower fp32 matmul precision, in the API the
    caller's settings are readable with (``full_fp32``). Restored in reverse: the global precision, first
    here, is restored last, since it sets every backend's switch consistently."""
    matmul = torch.backends.cuda.matmul
    try:
        torch.get_float32_matmul_precision(), matmul.allow_tf32
    except RuntimeError:  # the caller set the per-backend switches
        return [(lambda o=o: o.fp32_precision, lambda v, o=o: setattr(o, "fp32_precision", v), "ieee")
                for o in (matmul, torch.backends.mkldnn.matmul)]
    return [(torch.get_float32_matmul_precision, torch.set_float32_matmul_precision, "highest"),
            (lambda: matmul.allow_tf32, lambda v: setattr(matmul, "allow_tf32", v), False)]


@contextlib.contextmanager
def full_fp32():
    """float32 matmuls at full precision inside (no TF32, no bf16), the global settings restored on
    exit; nothing is touched when they already are. Switches change through the API the caller's
    settings are readable with (``_switches``): torch >= 2.9 refuses to mix the legacy and new APIs."""
    switches = _switches()
    saved = [read() for read, _, _ in switches]
    if all(value == full for value, (_, _, full) in zip(saved, switches)):
        yield
        return
    for _, write, full in switches:
        write(full)
    try:
        yield
    finally:
        for (_, write, _), value in reversed(list(zip(switches, saved))):
            write(value)


def round_half_up(x: float) -> int:
    """``round`` as people mean it (0.5 -> 1), not Python's banker's rounding (0.5 -> 0)."""
    return int(math.floor(x + 0.5 + 1e-9))


def mix_seed(*values: int) -> int:
    """Hash integers into a 63-bit seed (splitmix64 finaliser), so nearby windows and parameters
    get unrelated streams instead of overlapping ones."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h & ((1 << 63) - 1)


def generator(seed: int, window: int, ident: int = -1, *, device=None, shard=()) -> torch.Generator:
    """A private generator on ``device`` (default CPU) for one (seed, window, parameter[, shard])."""
    return torch.Generator(device=device or "cpu").manual_seed(mix_seed(seed, window, ident, *shard))


def random_subset(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """k distinct indices of range(n), sorted, uniform over the k-subsets, on ``gen``'s device, without
    a permutation of all n: the first k distinct values of i.i.d. uniform draws (about -n ln(1 - k/n)
    <= 0.7 n draws for k <= n/2; for k > n/2 the n - k left-out indices are drawn instead)."""
    device = gen.device
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    if 2 * k > n:
        keep = torch.ones(n, dtype=torch.bool, device=device)
        keep[random_subset(n, n - k, gen)] = False
        return keep.nonzero().flatten()
    drawn = torch.empty(0, dtype=torch.int64, device=device)
    count = int(-n * math.log1p(-k / n) * 1.05) + 16
    while True:
        drawn = torch.cat([drawn, torch.randint(n, (count,), generator=gen, device=device)])
        values, inverse = torch.unique(drawn, sorted=True, return_inverse=True)
        if values.numel() >= k:
            break
        count = 2 * (k - values.numel()) + 16
    first = torch.full((values.numel(),), drawn.numel(), dtype=torch.int64, device=device)
    first.scatter_reduce_(0, inverse, torch.arange(drawn.numel(), device=device), reduce="amin")
    # first draws are distinct positions: exactly k values have first <= the k-th smallest one
    return values[first <= first.kthvalue(k).values]


def block_count(num_blocks: int, density: float, granularity: str = "layer") -> int:
    """How many of the L blocks are state-full: ``layer``: round-half-up(density * L) (Appendix D's
    "round(rho * L) layers": 1/8 of 12 is 2); ``tensor``: Python's ``round`` over single weight tensors,
    banker's rounding included, as the authors' code (LLaMA-130M's 84: 1/8 -> 10; Table 16's
    densities); ``layer_floor``: ``int(density * L)`` layers, the badam package's blocks as the authors
    set them (the package refuses an L that k does not divide; the walk here wraps around)."""
    if granularity == "layer_floor":
        k = int(density * num_blocks)
    else:
        k = round(density * num_blocks) if granularity == "tensor" else round_half_up(density * num_blocks)
    return min(num_blocks, k)


def select_blocks(order: str, num_blocks: int, density: float, window: int, seed: int,
                  offset: int | None = None, granularity: str = "layer") -> list[int]:
    """Positions (0..L-1, module order; granularity ``tensor``: the param groups' tensor order,
    ``grouping.AUTHORS_TENSOR_ORDER`` with ``tensor_order="authors"``) of the state-full blocks in
    ``window``; k = ``block_count``. ascending: window w holds {(w*k + j) mod L : j < k}; descending
    (the paper's; Table 14): the same from the top (L-1 down, nearest the output first); mirror: the
    walk over 0, L-1, 1, L-2, ...; random: k blocks drawn from (seed, w). ``offset`` replaces ``w*k``
    as the walk's start (a changing density: the sum of earlier windows' k)."""
    if order not in BLOCK_ORDERS:
        raise ValueError(f"Unknown block_order {order!r}; valid choices: {', '.join(BLOCK_ORDERS)}")
    L = num_blocks
    k = block_count(L, density, granularity)
    if k == 0 or L == 0:
        return []
    if order == "random":
        perm = torch.randperm(L, generator=generator(seed, window))
        return sorted(perm[:k].tolist())
    start = window * k if offset is None else offset
    walk = [(start + j) % L for j in range(k)]
    if order == "descending":
        return sorted(L - 1 - i for i in walk)
    if order == "mirror":
        seq = [(i // 2) if i % 2 == 0 else L - 1 - i // 2 for i in range(L)]
        return sorted(seq[i] for i in walk)
    return sorted(walk)


def logical_shape(shape: torch.Size | tuple, transposed: bool) -> tuple[int, int]:
    m, n = shape[0], shape[1]
    return (n, m) if transposed else (m, n)


def matrix_side(shape, transposed: bool) -> str:
    """GaLore's ``std`` rule: project on the smaller side (``right`` = columns when m >= n)."""
    m, n = logical_shape(shape, transposed)
    return "right" if m >= n else "left"


def coordinate_dim(projection: str, shape, transposed: bool) -> int | None:
    """Stored dimension along which a coordinate projection selects (None = flattened, randk)."""
    if projection == "randk":
        return None
    if projection == "randperm":
        projection = "column" if matrix_side(shape, transposed) == "right" else "row"
    logical = 1 if projection == "column" else 0
    return 1 - logical if transposed else logical


def coordinate_count(projection: str, shape, transposed: bool, density: float) -> int:
    """Number of state-full coordinates: round(density * n_columns) for column (likewise row),
    round(density * numel) for randk, round(density * min(m, n)) for randperm (GaLore's rank)."""
    if projection == "randperm":
        return round_half_up(density * min(shape[0], shape[1]))
    dim = coordinate_dim(projection, shape, transposed)
    size = math.prod(shape) if dim is None else shape[dim]
    return round_half_up(density * size)


def index_dtype(projection: str, numel: int) -> torch.dtype:
    """How a coordinate projection keeps its indices. randk keeps k = density * numel of them, as
    many as the moments have elements: int32 (below 2^31 elements) halves that, at the cost of one
    conversion to int64 per step (torch's gathers and scatters run on int64). Column and row
    indices are tiny: int64."""
    return torch.int32 if projection == "randk" and numel < 2**31 else torch.int64


def coordinate_indices(projection, shape, transposed, density, seed, window, ident, device=None,
                       shard=()):
    """Sorted indices of the state-full coordinates on ``device`` (sorted for memory locality),
    a pure function of (seed, window, ident, shard); ``shard`` is a sharded tensor's position on
    its device mesh (FSDP2), so that shards draw different coordinates."""
    dim = coordinate_dim(projection, shape, transposed)
    size = math.prod(shape) if dim is None else shape[dim]
    k = coordinate_count(projection, shape, transposed, density)
    idx = random_subset(size, k, generator(seed, window, ident, device=device, shard=shard))
    return idx.to(index_dtype(projection, math.prod(shape)))


def matrix_rank(shape, density: float) -> int:
    return round_half_up(density * min(shape[0], shape[1]))


SVD_SIGNS = ("canonical", "raw")


def canonical_signs(q: torch.Tensor) -> torch.Tensor:
    """``q`` with each column's sign chosen so that its largest-magnitude entry is positive."""
    idx = q.abs().argmax(dim=0, keepdim=True)
    signs = torch.sign(q.gather(0, idx))
    return q * torch.where(signs == 0, torch.ones_like(signs), signs)


def matrix_projection(projection, grad, transposed, density, seed, window, ident, signs="canonical") -> torch.Tensor:
    """The ``s x r`` orthonormal-column matrix Q. svd (and power's first basis): the top-r singular
    vectors of the current gradient on the smaller side (GaLore), signs fixed (module docstring)
    unless ``signs="raw"`` (the SVD's own, as galore-torch);
    random: QR of a seeded Gaussian (gradient-free)."""
    g = grad.t() if transposed else grad
    side = matrix_side(grad.shape, transposed)
    r = matrix_rank(grad.shape, density)
    if projection in ("svd", "power"):
        # At least fp32 (bf16 has no SVD), as galore-torch does; fp64 stays fp64.
        work = g.to(torch.promote_types(g.dtype, torch.float32))
        with full_fp32():
            U, _, Vh = torch.linalg.svd(work, full_matrices=False)
        q = Vh[:r].t() if side == "right" else U[:, :r]
        q = q if signs == "raw" else canonical_signs(q)
    elif projection == "random":
        s = g.shape[1] if side == "right" else g.shape[0]
        # drawn on the CPU in float64 so every device and dtype gets the same basis
        gauss = torch.randn(s, max(r, 1), generator=generator(seed, window, ident), dtype=torch.float64)
        with full_fp32():
            q = torch.linalg.qr(gauss).Q[:, :r]
    else:
        raise ValueError(f"Unknown matrix projection {projection!r}; valid choices: {', '.join(MATRIX)}")
    return q.contiguous().to(device=grad.device, dtype=grad.dtype)


def project(grad: torch.Tensor, projection: str, transposed: bool, subspace: torch.Tensor) -> torch.Tensor:
    """The state-full (reduced) part of ``grad``; ``subspace`` is the index tensor or Q."""
    if projection in MATRIX:
        g = grad.t() if transposed else grad
        with full_fp32():
            return g @ subspace if matrix_side(grad.shape, transposed) == "right" else subspace.t() @ g
    dim = coordinate_dim(projection, grad.shape, transposed)
    if dim is None:
        return grad.view(-1).index_select(0, subspace)
    return grad.index_select(dim, subspace)


def reduced_dim(projection: str, shape, transposed: bool) -> tuple[int, bool]:
    """(the dimension the projection reduces, whether that is a dimension of the transpose).

    Matrix projections reduce the logical weight (a ``Conv1D`` weight's transpose): dimension 1
    for ``G Q``, 0 for ``Q^T G``. Coordinate projections select along a stored dimension (None for
    ``randk``, which has no other dimension)."""
    if projection in MATRIX:
        return (1 if matrix_side(shape, transposed) == "right" else 0), transposed
    return coordinate_dim(projection, shape, transposed), False


def write_coordinates_(out: torch.Tensor, projection: str, transposed: bool, index: torch.Tensor,
                       reduced: torch.Tensor) -> torch.Tensor:
    """``out[selected coordinates] = reduced`` in place (the inverse of ``project``'s gather)."""
    dim = coordinate_dim(projection, out.shape, transposed)
    if dim is None:
        out.view(-1).scatter_(0, index, reduced)  # much faster than a 1-D index_copy_
    elif dim == out.dim() - 1:
        out.scatter_(dim, index.expand(*out.shape[:-1], index.numel()), reduced)
    else:  # whole rows: index_copy_ copies contiguous slices (and needs int64 indices)
        out.index_copy_(dim, index.long(), reduced)
    return out


def project_back(reduced: torch.Tensor, shape, projection: str, transposed: bool,
                 subspace: torch.Tensor) -> torch.Tensor:
    """The full-shape tensor whose state-full part is ``reduced`` and whose complement is zero."""
    if projection in MATRIX:
        side = matrix_side(shape, transposed)
        with full_fp32():
            full = reduced @ subspace.t() if side == "right" else subspace @ reduced
        return full.t() if transposed else full
    out = torch.zeros(shape, dtype=reduced.dtype, device=reduced.device)
    return write_coordinates_(out, projection, transposed, subspace, reduced)


def reduced_shape(projection: str, shape, transposed: bool, density: float) -> tuple[int, ...]:
    """Shape of the state of one tensor under a coordinate or matrix projection."""
    if projection in MATRIX:
        m, n = logical_shape(shape, transposed)
        r = matrix_rank(shape, density)
        return (m, r) if matrix_side(shape, transposed) == "right" else (r, n)
    k = coordinate_count(projection, shape, transposed, density)
    dim = coordinate_dim(projection, shape, transposed)
    if dim is None:
        return (k,)
    return tuple(k if d == dim else s for d, s in enumerate(shape))
