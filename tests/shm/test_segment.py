from __future__ import annotations

import grp
import os
import stat
import subprocess
import threading
from pathlib import Path

import pytest

from kvstore.shm.segment import Segment, leftovers, remove_leftovers
from kvstore.shm.wake import WakeReader, WakeWriter, make_wake, unlink_wake, wake_path


def test_owner_only_and_cleanup() -> None:
    prefix = f"kvs.test.{os.getpid()}."
    seg = Segment.create(prefix + "a", 8192)
    bell = WakeReader.create(prefix + "wake.bell")
    stale_sem = Path("/dev/shm") / ("sem." + prefix + "s")  # what a version-3 service left behind
    stale_sem.write_bytes(b"\0" * 32)
    try:
        mode = stat.S_IMODE(os.stat(Path("/dev/shm") / (prefix + "a")).st_mode)
        assert mode == 0o600
        st = os.stat(wake_path(prefix + "wake.bell"))
        assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert leftovers(prefix) == sorted([prefix + "a", prefix + "wake.bell", "sem." + prefix + "s"])
        # a crashed service's leftovers: the next start removes them by prefix
        assert set(remove_leftovers(prefix)) == {prefix + "a", prefix + "wake.bell", "sem." + prefix + "s"}
        assert leftovers(prefix) == []
    finally:
        bell.close()
        seg.close()
        seg.unlink()
        unlink_wake(prefix + "wake.bell")
        stale_sem.unlink(missing_ok=True)


@pytest.fixture
def wake_name():  # type: ignore[no-untyped-def]
    name = f"kvs.test.{os.getpid()}.wake.x"
    yield name
    unlink_wake(name)


def test_many_posts_are_one_wake_up_and_none_is_left_over(wake_name: str) -> None:
    r = WakeReader.create(wake_name)
    w = WakeWriter.open(wake_name)
    try:
        assert r.wait(0.0) is False
        for _ in range(70000):  # more than the FIFO holds: the extra posts are dropped, never block
            w.post()
        assert r.wait(5.0) is True
        assert r.wait(0.0) is False  # every post made before the wait was taken by it
        w.post()
        assert r.wait(5.0) is True
    finally:
        w.close()
        r.close()
        r.close()  # idempotent


def test_no_wake_up_is_lost_between_two_processes(wake_name: str) -> None:
    """Ping-pong 2000 times through two wake-ups and a shared counter, the consumer checking
    before it waits (the protocol of every loop): a lost wake-up would leave one side waiting
    out its 30 s deadline."""
    pong = wake_name + "p"
    ping_r = WakeReader.create(wake_name)
    pong_r = WakeReader.create(pong)
    seg = Segment.create(wake_name + "seg", 4096)
    rounds = 2000
    code = f"""
import sys, time
from kvstore.shm.segment import Segment
from kvstore.shm.wake import WakeReader, WakeWriter
seg = Segment.attach({wake_name + "seg"!r})
ping, pong = WakeWriter.open({wake_name!r}), WakeReader.open({pong!r})
for i in range(1, {rounds} + 1):
    seg.buf[0:4] = i.to_bytes(4, "little")   # publish, then post
    ping.post()
    end = time.monotonic() + 30
    while int.from_bytes(seg.buf[4:8], "little") != i:   # check, then wait
        if time.monotonic() > end:
            sys.exit(f"lost the answer to round {{i}}")
        pong.wait(1.0)
seg.close()
"""
    child = subprocess.Popen([os.sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    pong_w = WakeWriter(os.open(wake_path(pong), os.O_WRONLY | os.O_NONBLOCK))
    try:
        for i in range(1, rounds + 1):
            deadline = threading.Event()
            timer = threading.Timer(30, deadline.set)
            timer.start()
            while int.from_bytes(seg.buf[0:4], "little") != i:
                assert not deadline.is_set(), f"lost the wake-up of round {i}"
                assert child.poll() is None, child.stderr.read() if child.stderr else ""
                ping_r.wait(1.0)
            timer.cancel()
            seg.buf[4:8] = i.to_bytes(4, "little")
            pong_w.post()
        assert child.wait(60) == 0, child.stderr.read() if child.stderr else ""
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        pong_w.close()
        ping_r.close()
        pong_r.close()
        seg.close()
        seg.unlink()
        unlink_wake(pong)


def test_the_group_may_post_but_never_wait(wake_name: str) -> None:
    """Mode 0620: a member of the access group opens the wake-up for writing, never for reading
    (a reader would take the consumer's wake-ups); anyone else opens it not at all."""
    if os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs root and a system python3 to run as another user")
    try:
        gid = grp.getgrnam("nogroup").gr_gid
    except KeyError:
        pytest.skip("no 'nogroup' group here")
    with pytest.raises(ValueError, match="must not let anyone else read"):
        make_wake(wake_name, 0o640, gid)
    r = WakeReader.create(wake_name, 0o620, gid)
    path = str(wake_path(wake_name))
    code = f"""
import os, errno
out = []
for flags in (os.O_RDONLY, os.O_RDWR, os.O_WRONLY):
    try:
        fd = os.open({path!r}, flags | os.O_NONBLOCK)
        if flags == os.O_WRONLY:
            os.write(fd, b"x")
        os.close(fd)
        out.append("ok")
    except OSError as e:
        out.append(errno.errorcode[e.errno])
print(" ".join(out))
"""

    def as_nobody(group: int) -> str:
        p = subprocess.run(["setpriv", "--reuid=65534", f"--regid={group}", "--clear-groups", "/usr/bin/python3",
                            "-c", code], capture_output=True, text=True, cwd="/", timeout=60)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip()

    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o620 and os.stat(path).st_gid == gid
        assert as_nobody(gid) == "EACCES EACCES ok"  # the group: post only
        assert r.wait(5.0) is True  # and the post arrived
        other = next(g.gr_gid for g in grp.getgrall() if g.gr_gid not in (gid, 0))
        assert as_nobody(other) == "EACCES EACCES EACCES"
    finally:
        r.close()


def test_adopt_refuses_what_is_not_a_fifo() -> None:
    rfd, wfd = os.pipe()  # a pipe is a FIFO: adopted, and it wakes
    r = WakeReader.adopt(rfd)
    assert r.wait(0.0) is False
    WakeWriter(wfd).post()
    assert r.wait(5.0) is True
    r.close()
    os.close(wfd)
    seg = Segment.create(f"kvs.test.{os.getpid()}.notfifo", 4096)
    try:
        fd = os.open(f"/dev/shm/{seg.name}", os.O_RDONLY)
        with pytest.raises(ValueError, match="not a FIFO"):
            WakeReader.adopt(fd)
    finally:
        seg.close()
        seg.unlink()


def test_a_post_to_a_gone_consumer_never_kills_the_poster(wake_name: str) -> None:
    """A program that restored SIGPIPE's default action (Python ignores it) posts to a wake-up
    whose consumer is gone, as a client does when its service was killed: it lives on, and no
    SIGPIPE stays pending for it."""
    code = f"""
import os, signal
from kvstore.shm.wake import WakeWriter, make_wake, wake_path
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
make_wake({wake_name!r})
r = os.open(wake_path({wake_name!r}), os.O_RDONLY | os.O_NONBLOCK)
w = WakeWriter.open({wake_name!r})
w.post()
os.close(r)          # the consumer is gone: a plain write now raises SIGPIPE
for _ in range(3):
    w.post()
assert signal.SIGPIPE not in signal.sigpending(), "a SIGPIPE was left pending"
assert signal.SIGPIPE not in signal.pthread_sigmask(signal.SIG_BLOCK, []), "SIGPIPE left blocked"
print("alive")
"""
    p = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "alive", (p.returncode, p.stderr)
