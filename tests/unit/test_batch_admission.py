"""The reference engine's admission rule: when requests queued behind a decoding batch are prefilled into it.

A prefill pauses every decoding row for its forward; requests that wait decode nothing. The worker admits
the queue once its waiting has cost as much as the prefill will pause (``BatchWorker._admit_now``), once it
would fill the batch, or after ``admit_wait_ms``. The rule is checked on the worker's real queue, with the
prefill time it would have measured set directly (no model: the decision needs none).
"""

from __future__ import annotations

import time

from eagle3_pipeline.engine.batcher import BatchWorker, GenerateJob, SamplingConfig


def queued(worker: BatchWorker, count: int) -> None:
    for i in range(count):
        worker.submit(GenerateJob(rid=f"r{i}", input_ids=[1, 2, 3], sampling=SamplingConfig(max_new_tokens=4)))


def test_an_idle_batch_admits_at_once():
    worker = BatchWorker(runner=None, max_batch_size=64)
    worker._prefill_estimate_s = 0.05
    assert not worker._admit_now(0)  # nothing queued
    queued(worker, 1)
    assert worker._admit_now(0)  # nothing decoding: a prefill pauses nobody


def test_behind_a_large_batch_requests_gather_until_their_wait_costs_what_the_prefill_pauses():
    worker = BatchWorker(runner=None, max_batch_size=64, admit_wait_ms=60_000)
    worker._prefill_estimate_s = 0.05  # 32 rows decoding: a prefill costs 32 x 0.05 = 1.6 row-seconds
    queued(worker, 2)
    assert not worker._admit_now(32)  # just queued: their wait has cost nothing yet
    worker._queued_since = time.monotonic() - 0.5
    assert not worker._admit_now(32)  # 2 x 0.5 = 1.0 < 1.6
    worker._queued_since = time.monotonic() - 0.9
    assert worker._admit_now(32)  # 2 x 0.9 = 1.8 >= 1.6
    worker._queued_since = None
    queued(worker, 14)  # 16 queued
    assert not worker._admit_now(32)
    worker._queued_since = time.monotonic() - 0.11
    assert worker._admit_now(32)  # 16 x 0.11 = 1.76: more requests waiting, a shorter wait


def test_a_queue_that_fills_the_batch_goes_at_once_and_none_goes_into_a_full_one():
    worker = BatchWorker(runner=None, max_batch_size=64, admit_wait_ms=60_000)
    worker._prefill_estimate_s = 10.0
    queued(worker, 2)
    assert worker._admit_now(62)  # room for 2, 2 queued: the batch is full after this prefill
    assert not worker._admit_now(64)  # no room: nothing to admit into


def test_no_request_waits_longer_than_admit_wait_ms():
    worker = BatchWorker(runner=None, max_batch_size=64, admit_wait_ms=30)
    worker._prefill_estimate_s = 10.0  # a prefill so dear the balance alone would wait minutes
    queued(worker, 1)
    assert not worker._admit_now(32)
    time.sleep(0.05)
    assert worker._admit_now(32)


class FreeSlots:
    """The one thing the admission rule asks the model runner: how many slots are free now."""

    def __init__(self, free: int) -> None:
        self.free = free

    def free_slots(self) -> int:
        return self.free


def test_requests_waiting_for_a_slot_gather_while_slots_free_up_instead_of_one_prefill_per_freed_slot():
    runner = FreeSlots(0)
    worker = BatchWorker(runner=runner, max_batch_size=512, admit_wait_ms=60_000)
    worker._prefill_estimate_s = 0.02  # 440 rows decoding: a prefill costs 440 x 0.02 = 8.8 row-seconds
    worker._held.extend(GenerateJob(rid=f"h{i}", input_ids=[1, 2], sampling=SamplingConfig(max_new_tokens=4))
                        for i in range(60))
    assert not worker._admit_now(440)  # every slot taken: nothing can join, however long the queue
    runner.free = 2
    # 60 waiting and room for 72 in the batch, but 2 free slots: not "the queue fills the batch" at once.
    assert not worker._admit_now(440)
    worker._queued_since = time.monotonic() - 1.0
    assert not worker._admit_now(440)  # 2 x 1.0 = 2 < 8.8: wait while more slots free up
    runner.free = 10
    assert worker._admit_now(440)  # 10 x 1.0 = 10 >= 8.8
    # Without requests waiting for a slot, the batch size is the room again, and a queue that fills it goes at once.
    worker._held.clear()
    worker._queued_since = None
    queued(worker, 72)
    assert worker._admit_now(440)
