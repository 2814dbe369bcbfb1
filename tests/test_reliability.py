"""PutQueue with pieces handed over: each put's release is called once, whatever becomes of it."""

import threading
from collections import Counter

from tierkv.reliability import CircuitBreaker, PendingPut, PutQueue


def test_every_handed_over_put_is_released_once_whatever_becomes_of_it() -> None:
    """Stored, failed, dropped for room, dropped while the breaker is open, dropped at close:
    each put's release() runs exactly once, and a sent one only after its send returned."""
    gate, sending = threading.Event(), threading.Event()
    sent: list[str] = []
    released: Counter[str] = Counter()
    outcome = {"fail": False}

    def send(batch: list[PendingPut]) -> int:
        sending.set()
        gate.wait(30)
        if outcome["fail"]:
            raise OSError("vault down")
        sent.extend(put.key.decode() for put in batch)
        assert b"".join(batch[0].pieces) == b"head" + b"body"
        return 0

    breaker = CircuitBreaker(failures=1, cooldown_s=3600, probe=lambda: False)
    queue = PutQueue("test", send, breaker, max_pending_bytes=24, batch_bytes=1)

    def put(name: str) -> None:
        def release() -> None:
            released[name] += 1

        queue.put(b"ns", name.encode(), 0, (b"head", memoryview(b"body")), release)

    put("stored")  # 8 bytes, taken by the sender, which waits at the gate
    assert sending.wait(30)
    assert released["stored"] == 0
    put("oldest")
    put("middle")
    put("newest")  # 32 bytes held > 24: "oldest" dropped for room, released at once
    assert released == {"oldest": 1}
    gate.set()
    assert queue.flush(30) is False  # one put was lost
    assert sent == ["stored", "middle", "newest"]
    assert released == {"stored": 1, "oldest": 1, "middle": 1, "newest": 1}
    gate.clear()
    sending.clear()
    outcome["fail"] = True
    put("failed")  # its send raises: the breaker opens (one failure)
    assert sending.wait(30)
    put("while open")
    gate.set()
    queue.flush(30)
    assert released["failed"] == 1
    put("after close")
    queue.close(timeout=1)
    breaker.stop()
    assert released["while open"] == 1 and released["after close"] == 1
    assert queue.failed_puts == 1 and queue.dropped_puts == 3


def test_flush_returns_only_once_the_puts_dropped_with_the_breaker_open_are_released() -> None:
    """The sender drops what is queued while the breaker is open and releases it: flush() must
    not say the queue is done before those releases have run (the caller may reuse the memory
    they hold once flush returns)."""
    breaker = CircuitBreaker(failures=1, cooldown_s=3600, probe=lambda: False)
    breaker.record_failure()
    releasing, let_go = threading.Event(), threading.Event()

    def release() -> None:
        releasing.set()
        let_go.wait(30)

    queue = PutQueue("test", lambda batch: 0, breaker, max_pending_bytes=1 << 20)
    queue.put(b"ns", b"k", 0, (b"head", memoryview(b"body")), release)
    assert releasing.wait(30)  # the sender has dropped it and is releasing it
    flushed: list[bool] = []
    flusher = threading.Thread(target=lambda: flushed.append(queue.flush(30)))
    flusher.start()
    flusher.join(0.3)
    assert not flushed  # still being released
    let_go.set()
    flusher.join(30)
    assert flushed == [False]  # answered once released, and reported lost
    queue.close(timeout=1)
    breaker.stop()
