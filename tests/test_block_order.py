"""BlockWindowOrder: the block schedule of docs/training.md ("Block windows") as a pure order."""

from __future__ import annotations

import numpy as np
import pytest

from smstore.sampling import BlockWindowOrder

SIZES = [5, 0, 17, 3, 40, 1, 64, 9]

CASES = [
    # (shard sizes, block, group, spread)
    (SIZES, 4, 2, 3),
    (SIZES, 4, 1, 1),
    (SIZES, 1, 1, 1),
    (SIZES, 100, 1, 1),  # every shard one block
    (SIZES, 8, 3, 20),  # parts of less than one record: most are empty
    (SIZES, 3, 50, 2),  # one group holds every block
    ([7], 10, 1, 5),
    ([0, 0], 4, 1, 2),
    ([], 4, 1, 2),
    ([1000] * 12, 64, 2, 8),
]


def full(o: BlockWindowOrder) -> np.ndarray:
    return o(np.arange(o.n))


def group_of_records(o: BlockWindowOrder) -> np.ndarray:
    """Each record's group, from its place in the sequence (the blocks in their keyed order)."""
    sequence = [
        np.arange(o.block_first[b], o.block_first[b] + o.block_length[b]) for b in o.block_order.tolist()
    ]
    records = np.concatenate([*sequence, np.zeros(0, np.int64)])
    group = np.empty(o.n, dtype=np.int64)
    group[records] = np.searchsorted(o.group_starts, np.arange(o.n), side="right") - 1
    return group


@pytest.mark.parametrize(("sizes", "block", "group", "spread"), CASES)
def test_every_record_comes_exactly_once(sizes: list[int], block: int, group: int, spread: int) -> None:
    o = BlockWindowOrder(sizes, block=block, group=group, spread=spread, key="k")
    assert len(o) == sum(sizes)
    assert sorted(full(o).tolist()) == list(range(sum(sizes)))


@pytest.mark.parametrize(("sizes", "block", "group", "spread"), CASES)
def test_blocks_are_runs_of_one_shard_of_at_least_a_block_and_groups_cover_them(
    sizes: list[int], block: int, group: int, spread: int
) -> None:
    o = BlockWindowOrder(sizes, block=block, group=group, spread=spread, key="k")
    n = sum(sizes)
    ends = np.cumsum(sizes)
    covered = []
    for first, length, shard in zip(
        o.block_first.tolist(), o.block_length.tolist(), o.block_shard.tolist(), strict=True
    ):
        start = ends[shard - 1] if shard else 0
        assert start <= first  # within one shard: one sequential read
        assert first + length <= ends[shard]
        # At least a block (unless the whole shard is shorter), less than two.
        assert min(block, sizes[shard]) <= length < 2 * block or length == sizes[shard] < block
        covered += range(first, first + length)
    assert covered == list(range(n))
    # Groups are runs of G records of the sequence: a block lies in one group or runs into the next.
    groups = len(o.group_starts) - 1
    sizes_g = np.diff(o.group_starts)
    assert set(sizes_g[:-1].tolist()) <= {group * block}
    sequence = np.concatenate([[0], np.cumsum(o.block_length[o.block_order])])
    for j in range(groups):
        bs = o.group_blocks(j).tolist()
        k = [int(np.flatnonzero(o.block_order == b)[0]) for b in bs]
        assert k == list(range(k[0], k[0] + len(k)))  # consecutive in the sequence
        assert sequence[k[0]] <= o.group_starts[j] < sequence[k[0] + 1]
        assert sequence[k[-1]] < o.group_starts[j + 1] <= sequence[k[-1] + 1]


def test_every_block_is_at_least_a_block_of_records_so_reads_are_never_short() -> None:
    """Shards of any size cut into blocks of at least `block` records: no read at a shard's end
    is shorter (the old cut ran blocks across shard ends, leaving short pieces there)."""
    rng = np.random.default_rng(3)
    sizes = rng.integers(0, 5000, size=40).tolist()
    o = BlockWindowOrder(sizes, block=700, group=1, spread=5, key="k")
    big = [s for s in sizes if s >= 700]
    lengths = o.block_length[np.isin(o.block_shard, np.flatnonzero(np.asarray(sizes) >= 700))]
    assert len(lengths) == sum(s // 700 for s in big)
    assert lengths.min() >= 700


@pytest.mark.parametrize(("sizes", "block", "group", "spread"), CASES)
def test_a_window_reads_only_the_groups_resident_for_it(
    sizes: list[int], block: int, group: int, spread: int
) -> None:
    """While window w is read, only groups w - spread + 1 .. w are needed (and w + 1 loads):
    (spread + 1) groups resident, and every record of a group comes out in its spread windows."""
    o = BlockWindowOrder(sizes, block=block, group=group, spread=spread, key="k")
    records = full(o)
    group_of_record = group_of_records(o)
    for w in range(o.window_count):
        lo, hi = int(o.window_starts[w]), int(o.window_starts[w + 1])
        allowed = set(o.window_groups(w))
        assert len(allowed) <= spread
        assert set(group_of_record[records[lo:hi]].tolist()) <= allowed
        # Resident meanwhile: those groups and the next (loading), (spread + 1) G records, and the
        # rest of a block at each end (less than two blocks each).
        needed = {
            b
            for j in range(w - spread + 1, w + 2)
            if 0 <= j < len(o.group_starts) - 1
            for b in o.group_blocks(j).tolist()
        }
        assert sum(int(o.block_length[b]) for b in needed) <= (spread + 1) * group * block + 2 * (
            2 * block - 1
        )
    assert o.window_starts[-1] == o.n


def test_a_group_is_spread_evenly_over_its_windows() -> None:
    """Each part of a group holds as many of its records as whole records allow (G // spread or one more)."""
    sizes, block, group, spread = [1000] * 12, 64, 2, 8
    o = BlockWindowOrder(sizes, block=block, group=group, spread=spread, key="k")
    records = full(o)
    window_of_position = np.searchsorted(o.window_starts, np.arange(o.n), side="right") - 1
    j = 5
    mine = np.flatnonzero(group_of_records(o) == j)
    where = np.flatnonzero(np.isin(records, mine))
    counts = np.bincount(window_of_position[where] - j, minlength=spread)
    assert len(counts) == spread
    assert counts.sum() == len(mine)
    assert counts.max() - counts.min() <= 1


@pytest.mark.parametrize(("block", "group", "spread"), [(64, 1, 29), (64, 1, 123), (15, 1, 531), (64, 2, 8)])
def test_source_neighbours_are_dealt_to_windows_far_apart(block: int, group: int, spread: int) -> None:
    """Records adjacent in a block come out at least spread / 5 windows apart, in one group or
    across two: the deal's step puts them there, not chance (the old random cut put about 1 in
    `spread` in one window)."""
    sizes = [1000] * 12
    o = BlockWindowOrder(sizes, block=block, group=group, spread=spread, key="k")
    window_of_record = np.empty(o.n, dtype=np.int64)
    window_of_record[full(o)] = np.searchsorted(o.window_starts, np.arange(o.n), side="right") - 1
    block_of_record = np.repeat(np.arange(len(o.block_first)), o.block_length)
    same_block = block_of_record[:-1] == block_of_record[1:]
    group_of_record = group_of_records(o)
    across = same_block & (group_of_record[:-1] != group_of_record[1:])
    assert across.sum() > 0  # blocks of a little over `block` records run on across groups
    gaps = np.abs(np.diff(window_of_record))
    assert gaps[same_block].min() >= spread // 5


@pytest.mark.parametrize(("sizes", "block", "group", "spread"), CASES)
def test_any_positions_give_the_records_of_the_whole_order(
    sizes: list[int], block: int, group: int, spread: int
) -> None:
    """O(1) resume and any world size: a position's record needs no other position."""
    o = BlockWindowOrder(sizes, block=block, group=group, spread=spread, key="k")
    whole = full(o)
    rng = np.random.default_rng(0)
    if o.n:
        some = rng.integers(0, o.n, size=50)
        assert o(some).tolist() == whole[some].tolist()
        assert o(some.reshape(5, 10)).shape == (5, 10)
        assert o(np.array([o.n - 1])).tolist() == [whole[-1]]
    for world in (2, 3, 8):
        ranks = [o(np.arange(r, o.n, world)) for r in range(world)]
        interleaved = np.empty(o.n, dtype=np.int64)
        for r, part in enumerate(ranks):
            interleaved[r::world] = part
        assert interleaved.tolist() == whole.tolist()


def test_the_order_is_a_function_of_the_key() -> None:
    def make(key: str) -> list[int]:
        return full(BlockWindowOrder([1000] * 6, block=32, group=2, spread=4, key=key)).tolist()

    assert make("seed 1, epoch 0") == make("seed 1, epoch 0")
    assert make("seed 1, epoch 0") != make("seed 1, epoch 1")


def test_one_group_of_every_block_is_one_exact_shuffle() -> None:
    o = BlockWindowOrder([300] * 4, block=16, group=1000, spread=1, key="k")
    assert o.window_count == 1
    records = full(o)
    assert sorted(records.tolist()) == list(range(1200))
    # Shuffled across the shards, not shard by shard.
    assert len(set((records[:64] // 300).tolist())) == 4


@pytest.mark.parametrize(
    "kwargs",
    [{"block": 0}, {"group": 0}, {"spread": -1}, {"spread": True}, {"block": 2.0}],
)
def test_bad_arguments_are_refused(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"block": 4, "group": 1, "spread": 2, **kwargs}
    with pytest.raises(ValueError, match="must be a positive integer"):
        BlockWindowOrder(SIZES, key="k", **args)  # type: ignore[arg-type]


def test_a_negative_shard_size_is_refused() -> None:
    with pytest.raises(ValueError, match="shard sizes must be >= 0"):
        BlockWindowOrder([3, -1], block=4, group=1, spread=1, key="k")


def test_positions_outside_the_order_are_refused() -> None:
    o = BlockWindowOrder(SIZES, block=4, group=1, spread=2, key="k")
    for bad in (-1, o.n):
        with pytest.raises(IndexError, match=f"position {bad} out of range"):
            o(np.array([0, bad]))


def test_a_long_epoch_with_a_wide_spread_is_read_anywhere_at_once() -> None:
    """Ten million records in 1.25 million blocks spread over 100,000 windows each: the tables grow
    with blocks and windows, not with groups x spread (10^11 entries), and the last positions are
    read without the others."""
    o = BlockWindowOrder([1_000_000] * 10, block=8, group=1, spread=100_000, key="k")
    assert o.window_count == 1_250_000 + 100_000 - 1
    tail = o(np.arange(o.n - 1000, o.n))
    assert len(set(tail.tolist())) == 1000
    assert int(tail.min()) >= 0
    assert int(tail.max()) < o.n
