"""The engine process's outbox (app/outbox.py): what the window receives, in which batches."""
import multiprocessing as mp

from app.outbox import Outbox


def receive(conn, timeout_s: float = 10.0):
    assert conn.poll(timeout_s), "nothing arrived"
    kind, batch = conn.recv()
    assert kind == "batch"
    return batch


def test_steps_go_with_the_next_signal_in_one_batch_and_in_order():
    mine, theirs = mp.Pipe()
    out = Outbox(mine)
    for i in range(5):
        out.append(i)
    out.signal("text", "Hello")
    assert receive(theirs) == [("step", 0), ("step", 1), ("step", 2), ("step", 3), ("step", 4),
                               ("signal", "text", ("Hello",))]
    out.close()
    assert not out.thread.is_alive()


def test_steps_alone_are_sent_all_the_same_and_closing_sends_what_is_left():
    mine, theirs = mp.Pipe()
    out = Outbox(mine)
    out.append("a")                                  # no signal follows: it goes after a short wait
    assert receive(theirs) == [("step", "a")]
    out.append("b")
    out.put(("done", {"history": []}))
    out.append("c")
    out.close()                                      # the rest goes before the thread ends
    got = receive(theirs)
    got += receive(theirs) if theirs.poll(1.0) else []
    assert got == [("step", "b"), ("done", {"history": []}), ("step", "c")]
    assert not out.thread.is_alive() and not theirs.poll(0.2)
