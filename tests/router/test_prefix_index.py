import random

import pytest

from router.hashing import hash_block_tokens
from router.prefix_index import SHARED_STORE, PrefixIndex
from router.tiers import Tier

BLOCK = 4


def hashes(num_blocks: int, first_token: int = 0) -> list[bytes]:
    return hash_block_tokens(list(range(first_token, first_token + num_blocks * BLOCK)), BLOCK)


def test_match_is_the_leading_run_per_replica():
    prompt = hashes(4)
    index = PrefixIndex(max_blocks=100)
    index.insert("a", prompt[:3])
    index.insert("b", prompt[:1])
    index.insert("b", prompt[2:3])  # a later block without the one before it cannot be reused
    index.insert("c", hashes(2, first_token=1000))
    assert index.match(prompt) == {"a": 3, "b": 1}
    assert index.match(prompt[:2]) == {"a": 2, "b": 1}
    assert index.match([]) == {}
    assert index.match(hashes(3, first_token=500)) == {}
    assert len(index) == 3 + 2 + 2


def test_replica_holding_the_whole_prompt_matches_all_of_it():
    prompt = hashes(5)
    index = PrefixIndex(max_blocks=100)
    index.insert("a", prompt)
    index.insert("b", prompt[:2])
    assert index.match(prompt) == {"a": 5, "b": 2}
    assert index.num_blocks("a") == 5 and index.num_blocks("b") == 2 and index.num_blocks("z") == 0


def test_reinsert_refreshes_without_duplicating():
    prompt = hashes(3)
    index = PrefixIndex(max_blocks=100)
    index.insert("a", prompt)
    index.insert("a", prompt)
    assert len(index) == 3
    assert index.num_blocks("a") == 3


def test_bound_drops_least_recently_inserted_entries_tail_first():
    first, second = hashes(3), hashes(3, first_token=100)
    index = PrefixIndex(max_blocks=4)
    index.insert("a", first)  # LRU order: a2, a1, a0 (the head is the most recent)
    index.insert("b", second)  # needs 3 more: a2 and a1 go
    assert len(index) == 4
    assert index.num_dropped == 2
    assert index.match(first) == {"a": 1}
    assert index.match(second) == {"b": 3}
    assert (first[0], "a") in index and (first[1], "a") not in index


def test_refreshed_entries_outlive_stale_ones():
    first, second, third = hashes(2), hashes(2, first_token=100), hashes(2, first_token=200)
    index = PrefixIndex(max_blocks=4)
    index.insert("a", first)
    index.insert("a", second)
    index.insert("a", first)  # first is now the most recent
    index.insert("a", third)  # evicts second, the stalest
    assert index.match(first) == {"a": 2}
    assert index.match(second) == {}
    assert index.match(third) == {"a": 2}


def test_learns_from_evictions():
    prompt = hashes(4)
    index = PrefixIndex(max_blocks=100)
    index.insert("a", prompt)
    index.insert("b", prompt)
    index.evict("a", [prompt[2]])
    assert index.match(prompt) == {"a": 2, "b": 4}
    index.evict("b", [prompt[0]])  # without its first block, nothing of b's copy is reusable
    assert index.match(prompt) == {"a": 2}
    index.evict("a", [prompt[2], hashes(1, first_token=999)[0]])  # unknown and repeated: ignored
    index.evict("nobody", prompt)
    assert len(index) == 3 + 3
    assert index.num_blocks("a") == 3 and index.num_blocks("b") == 3


def test_remove_replica_forgets_only_that_replica():
    prompt = hashes(3)
    index = PrefixIndex(max_blocks=100)
    index.insert("a", prompt)
    index.insert("b", prompt[:2])
    index.remove_replica("a")
    index.remove_replica("never-seen")
    index.insert("c", [])  # an empty prompt holds nothing: "c" is no replica of the index
    assert index.match(prompt) == {"b": 2}
    assert index.replica_ids() == ["b"] and index.num_blocks("c") == 0
    assert len(index) == 2


def test_random_operations_keep_the_bound_and_agree_with_a_model():
    rng = random.Random(0)
    bound = 50
    index = PrefixIndex(max_blocks=bound)
    prompts = [hashes(rng.randint(1, 8), first_token=1000 * i) for i in range(20)]
    for _ in range(2000):
        replica = rng.choice("abcd")
        prompt = rng.choice(prompts)
        operation = rng.random()
        if operation < 0.6:
            index.insert(replica, prompt)
        elif operation < 0.95:
            index.evict(replica, rng.sample(prompt, rng.randint(1, len(prompt))))
        else:
            index.remove_replica(replica)
        assert len(index) <= bound
        # match agrees with a direct reading of the entries
        probe = rng.choice(prompts)
        expected = {}
        for holder in "abcd":
            run = 0
            while run < len(probe) and (probe[run], holder) in index:
                run += 1
            if run:
                expected[holder] = run
        assert index.match(probe) == expected
        subset = rng.sample("abcd", rng.randint(1, 4))
        assert index.match_tiers(probe, subset) == {
            holder: (Tier.DEVICE,) * run for holder, run in expected.items() if holder in subset}
        assert sum(index.num_blocks(holder) for holder in "abcd") == len(index)


def _tree_prompts(rng: random.Random, count: int) -> list[list[bytes]]:
    """Prompts that share prefixes: each a random earlier one's leading blocks (or none), then blocks of its own."""
    prompts: list[list[bytes]] = []
    for number in range(count):
        head = rng.choice(prompts)[:rng.randint(1, 6)] if prompts and rng.random() < 0.7 else []
        own = rng.randint(1, 5)
        tokens = [50_000 + 100 * number + position for position in range(own * BLOCK)]
        prompts.append(head + hash_block_tokens(tokens, BLOCK, parent_hash=head[-1]) if head
                       else hash_block_tokens(tokens, BLOCK))
    return prompts


def _walked_run(index: PrefixIndex, replica_id: str, prompt: list[bytes]) -> int:
    run = 0
    while run < len(prompt) and (prompt[run], replica_id) in index:
        run += 1
    return run


def _check_known_whole(index: PrefixIndex) -> None:
    """Every known block is held, and so is the block before it (a prompt's first has none)."""
    for replica_id, whole in index._whole.items():
        before_of = {}
        for block_hash, after in whole.after.items():
            assert (block_hash, replica_id) in index
            if after in whole.after:
                before_of[after] = block_hash
        before_of.update(whole.starts)
        assert set(before_of) == set(whole.after)
        assert all(before is None or before in whole.after for before in before_of.values())
        branches = {}
        for before in whole.starts.values():
            if before is not None:
                branches[before] = branches.get(before, 0) + 1
        assert whole.branches == branches


def test_random_routed_prompts_reports_and_evictions_give_exact_runs_without_walking_known_ones():
    """Prompts sharing prefixes, routed (known whole once inserted), reported as loose blocks (never known
    whole), evicted in any order, forgotten past the bound, replicas removed: every run is the walked run,
    and what is known is held, with all before it."""
    rng = random.Random(2)
    index = PrefixIndex(max_blocks=60)
    prompts = _tree_prompts(rng, 40)
    for _ in range(3000):
        replica, prompt, operation = rng.choice("abc"), rng.choice(prompts), rng.random()
        if operation < 0.45:
            index.insert(replica, prompt, prompt=True)
        elif operation < 0.6:  # a report: stored blocks in the events' order, not a prompt
            index.insert(replica, rng.sample(prompt, rng.randint(1, len(prompt))))
        elif operation < 0.97:
            index.evict(replica, rng.sample(prompt, min(len(prompt), rng.randint(1, 2))))
        else:
            index.remove_replica(replica)
        probe = rng.choice(prompts)
        expected = {holder: run for holder in "abc" if (run := _walked_run(index, holder, probe))}
        assert index.match_tiers(probe, "abc") == {holder: (Tier.DEVICE,) * run for holder, run in expected.items()}
        _check_known_whole(index)
    assert index._whole  # the runs were known, not only walked


def test_a_routed_context_is_known_whole_and_its_next_turn_walks_only_its_own_blocks():
    """A routed prompt is known whole, so the next turn's run is a binary search plus one lookup; the
    replica's evicting another prompt's blocks, last first, keeps it known; evicting a block inside it
    forgets what the replica knew, and the next match walks again, exactly."""
    context, other = hashes(40), hashes(6, first_token=9000)
    index = PrefixIndex(max_blocks=1000)
    index.insert("a", context, prompt=True)
    index.insert("a", other, prompt=True)
    turn = context + hash_block_tokens([7] * (2 * BLOCK), BLOCK, parent_hash=context[-1])
    looked = []
    held = index._held["a"]
    index._held["a"] = type("Counted", (set,), {"__contains__": lambda self, h: looked.append(h) or
                                                 set.__contains__(self, h)})(held)
    assert index.match_tiers(turn, ["a"]) == {"a": (Tier.DEVICE,) * 40}
    assert looked == [turn[40]]  # the known 40 by binary search; one lookup past them
    index.evict("a", reversed(other))  # another prompt's blocks, tail first: each is a leaf there
    assert len(index._whole["a"].after) == 40
    index.evict("a", [context[30]])  # inside the context: what was known after it is not whole any more
    assert "a" not in index._whole
    assert index.match_tiers(turn, ["a"]) == {"a": (Tier.DEVICE,) * 30}
    assert index._whole["a"].run(turn) == 30


def _two_alike(prompt: list[bytes], *held: tuple[str, list[bytes]],
               max_blocks: int = 100) -> tuple[PrefixIndex, PrefixIndex]:
    """Two indexes in the same state: "a" holding ``prompt``'s first four blocks, then ``held``."""
    pair = PrefixIndex(max_blocks), PrefixIndex(max_blocks)
    for index in pair:
        for replica_id, block_hashes in (("a", prompt[:4]), *held):
            index.insert(replica_id, block_hashes)
    return pair


def test_an_aged_held_head_is_refreshed_after_the_new_tail_as_one_block_at_a_time_would():
    """The fast path (the held head moved in C) leaves the LRU order of the slow one: last block first.

    The head has aged: 5 entries were touched after it, over a quarter of the bound of 12."""
    prompt, other = hashes(6), hashes(3, first_token=500)
    fast, slow = _two_alike(prompt, ("a", other), ("b", prompt[:2]), max_blocks=12)
    fast.insert("a", prompt)
    slow.insert("a", prompt[4:])  # the tail, then the head, block by block
    for block_hash in reversed(prompt[:4]):
        slow.insert("a", [block_hash])
    assert list(fast._lru) == list(slow._lru)
    assert list(fast._lru)[-1] == (prompt[0], "a") and fast.num_blocks("a") == 9


def test_a_young_held_head_stays_where_it_is_and_a_hot_context_outlives_cold_traffic():
    """A head touched less than a quarter of the bound ago is not moved (the tail goes in after it); one
    touched longer ago is. A context every other request reuses is never forgotten under a stream of
    prompts that no one reuses, on an index a twentieth of their size."""
    prompt = hashes(6)
    index = PrefixIndex(max_blocks=100)
    index.insert("a", prompt[:4])
    index.insert("a", prompt)
    assert list(index._lru) == [(h, "a") for h in (*reversed(prompt[:4]), prompt[5], prompt[4])]
    index.insert("b", hashes(26, first_token=900))  # 26 entries more: the head is now over a quarter old
    index.insert("a", prompt)
    assert list(index._lru)[-6:] == [(h, "a") for h in reversed(prompt)]

    hot = hashes(8, first_token=2000)
    index = PrefixIndex(max_blocks=40)
    for turn in range(400):
        tail = hash_block_tokens([3000 + turn] * BLOCK, BLOCK, parent_hash=hot[-1])
        index.insert("a", hot + tail)
        index.insert("b", hashes(2, first_token=10_000 + 10 * turn))
        assert index.match(hot)["a"] == 8 and len(index) <= 40
    assert index.num_dropped > 700


def test_a_run_the_caller_found_is_not_walked_again_and_every_change_counts():
    prompt = hashes(6)
    told, walked = _two_alike(prompt, ("a", hashes(3, first_token=500)))
    version = told.version
    told._run_of = None  # a walk would fail: the run given is used
    told.insert("a", prompt, held=4)
    walked.insert("a", prompt)
    assert list(told._lru) == list(walked._lru) and told.version == version + 1
    told.evict("a", prompt[5:])
    told.remove_replica("b")
    assert told.version == version + 3


def test_the_bound_is_kept_when_a_held_head_meets_a_new_tail():
    prompt = hashes(6)
    index = PrefixIndex(max_blocks=5)
    index.insert("a", prompt[:4])
    index.insert("a", prompt)  # 6 entries for a bound of 5: the oldest touched, the last block, goes
    assert len(index) == 5 and index.match(prompt) == {"a": 5} and index.num_dropped == 1


def test_deepest_holders_finds_the_longest_prefix_without_a_step_per_replica():
    prompt = hashes(8)
    index = PrefixIndex(max_blocks=1000)
    assert index.deepest_holders(prompt) == (0, [])
    for replica in "abcdefgh":
        index.insert(replica, prompt[:2])  # a shared head everyone holds
    index.insert("c", prompt[:6])
    index.insert("e", prompt[:6])
    index.insert(SHARED_STORE, prompt, Tier.SHARED)  # the shared store is no holder of its own
    depth, holders = index.deepest_holders(prompt)
    assert depth == 6 and sorted(holders) == ["c", "e"]
    assert index.deepest_holders(prompt[:2])[0] == 2 and len(index.deepest_holders(prompt[:2])[1]) == 8
    assert index.deepest_holders(hashes(3, first_token=900)) == (0, [])


def test_max_blocks_must_be_positive():
    with pytest.raises(ValueError):
        PrefixIndex(max_blocks=0)


def test_a_block_reinserted_in_another_tier_moves_there():
    prompt = hashes(3)
    index = PrefixIndex(max_blocks=100)
    index.insert("a", prompt)
    assert [index.tier(h, "a") for h in prompt] == [Tier.DEVICE] * 3  # routing's optimistic insertion
    index.insert("a", prompt[1:], Tier.HOST)
    index.insert("a", prompt[2:], Tier.DISK)
    assert [index.tier(h, "a") for h in prompt] == [Tier.DEVICE, Tier.HOST, Tier.DISK]
    assert len(index) == 3 and index.num_blocks("a") == 3
    assert index.match(prompt) == {"a": 3}  # match counts a replica's copies in any tier
    assert index.match_tiers(prompt) == {"a": (Tier.DEVICE, Tier.HOST, Tier.DISK)}
    index.insert("a", prompt, Tier.DEVICE)  # promoted back
    assert index.match_tiers(prompt) == {"a": (Tier.DEVICE,) * 3}


def test_the_shared_store_counts_for_every_replica_and_an_own_copy_wins():
    """The module docstring's diagram."""
    prompt = hashes(4)
    index = PrefixIndex(max_blocks=100)
    index.insert("a", prompt[:1])
    index.insert("a", prompt[1:2], Tier.HOST)
    index.insert(SHARED_STORE, prompt[:3], Tier.SHARED)
    assert index.match_tiers(prompt, ["a", "b"]) == {
        "a": (Tier.DEVICE, Tier.HOST, Tier.SHARED), "b": (Tier.SHARED,) * 3}
    assert index.match_tiers(prompt) == {"a": (Tier.DEVICE, Tier.HOST, Tier.SHARED)}  # the replicas it knows
    assert index.match_tiers(prompt, ["c"]) == {"c": (Tier.SHARED,) * 3}
    # The shared store is no replica: match (own copies) and replica_ids leave it out.
    assert index.match(prompt) == {"a": 2} and index.replica_ids() == ["a"]
    index.evict(SHARED_STORE, prompt[1:2])
    assert index.match_tiers(prompt, ["a", "b"]) == {"a": (Tier.DEVICE, Tier.HOST, Tier.SHARED), "b": (Tier.SHARED,)}
    index.remove_replica("a")
    assert index.match_tiers(prompt, ["a"]) == {"a": (Tier.SHARED,)}


def test_random_tiered_operations_keep_the_bound_and_agree_with_a_model():
    rng = random.Random(1)
    bound = 60
    index = PrefixIndex(max_blocks=bound)
    prompts = [hashes(rng.randint(1, 8), first_token=1000 * i) for i in range(20)]
    holders = ["a", "b", "c", SHARED_STORE]
    for step in range(3000):
        holder, prompt = rng.choice(holders), rng.choice(prompts)
        operation = rng.random()
        if operation < 0.6:
            tier = Tier.SHARED if holder == SHARED_STORE else rng.choice([Tier.DEVICE] * 3 + [Tier.HOST, Tier.DISK])
            index.insert(holder, prompt, tier)
        elif operation < 0.95:
            index.evict(holder, rng.sample(prompt, rng.randint(1, len(prompt))))
        else:
            index.remove_replica(holder)
        assert len(index) <= bound
        probe = rng.choice(prompts)
        expected = {}
        for replica in "abc":
            run = []
            for block_hash in probe:
                tier = index.tier(block_hash, replica)
                if tier is None and (block_hash, SHARED_STORE) in index:
                    tier = Tier.SHARED
                if tier is None:
                    break
                run.append(tier)
            if run:
                expected[replica] = tuple(run)
        assert index.match_tiers(probe, "abc") == expected, step
        assert sum(index.num_blocks(holder) for holder in holders) == len(index)
