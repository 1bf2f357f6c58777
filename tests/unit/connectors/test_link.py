"""The connectors' daemon link: lazy clients, shared or one per thread, and a down state
that makes an absent daemon cost nothing but a miss (a fake Client stands in for the
daemon)."""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import pytest

import kvfabric_connectors.link as link_module
from kvfabric.errors import AuthError, NotFoundError, UnavailableError
from kvfabric_connectors.link import DaemonLink, LinkDownError, held_prefix


class FakeClient:
    refuse: ClassVar[BaseException | None] = None  # what connecting raises, when set
    opened: ClassVar[list[FakeClient]] = []

    def __init__(self, address: str, **options: Any) -> None:
        if FakeClient.refuse is not None:
            raise FakeClient.refuse
        self.options = options
        self.closed = False
        FakeClient.opened.append(self)

    def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def fake_client(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeClient.refuse, FakeClient.opened = None, []
    monkeypatch.setattr(link_module, "Client", FakeClient)


def new_link(**options: Any) -> DaemonLink:
    return DaemonLink("/nowhere.sock", "t", timeout=1.0, engine="test", **options)


def clients_of_threads(link: DaemonLink, n: int) -> list[Any]:
    got: list[Any] = [None] * n

    def take(i: int) -> None:
        got[i] = link.client()

    threads = [threading.Thread(target=take, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def test_a_shared_link_connects_once_for_every_thread() -> None:
    link = new_link()
    clients = clients_of_threads(link, 4)
    assert len(FakeClient.opened) == 1 and all(c is clients[0] for c in clients)
    assert clients[0].options["engine"] == "test"


def test_a_per_thread_link_gives_each_thread_its_own_client_and_closes_them_all() -> None:
    link = new_link(per_thread=True)
    clients = clients_of_threads(link, 4)
    assert len({id(c) for c in clients}) == 4
    assert link.client() is link.client()  # this thread keeps its own
    link.close()
    assert all(c.closed for c in FakeClient.opened)
    assert link.client() not in FakeClient.opened[:5]  # a later call connects again


@pytest.mark.parametrize("per_thread", [False, True])
def test_a_connection_failure_drops_the_client_and_stays_away_for_a_while(
    per_thread: bool,
) -> None:
    link = new_link(per_thread=per_thread, retry_after_s=60.0)
    client = link.client()
    link.failed(NotFoundError("a miss is not a link failure"))
    assert link.client() is client
    link.failed(UnavailableError("gone"))
    assert FakeClient.opened == [client] and FakeClient.opened[0].closed
    assert link.failures == 1
    with pytest.raises(UnavailableError, match="unavailable"):
        link.client()  # at once: no connection attempt while the daemon is down
    assert len(FakeClient.opened) == 1


def test_a_refused_token_counts_as_down_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    FakeClient.refuse = AuthError("missing or invalid token")
    link = new_link(retry_after_s=60.0)
    with pytest.raises(UnavailableError):
        link.client()
    with pytest.raises(UnavailableError):
        link.client()
    assert link.failures == 1  # the second call did not try again
    assert "refused test's token" in caplog.text


def test_a_daemon_that_comes_back_is_used_again() -> None:
    FakeClient.refuse = UnavailableError("no socket")
    link = new_link(retry_after_s=0.0)
    with pytest.raises(UnavailableError):
        link.client()
    FakeClient.refuse = None
    assert link.client() is FakeClient.opened[0]


def test_held_prefix_counts_leading_hits_only() -> None:
    assert held_prefix([True, True, False, True]) == 2
    assert held_prefix([]) == 0


def test_asking_while_down_does_not_push_the_retry_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a step that found the link down reported that refusal as a failure,
    which moved the retry forward, so under steady traffic the link never retried."""
    now = [100.0]
    monkeypatch.setattr(link_module.time, "monotonic", lambda: now[0])
    link = new_link(retry_after_s=2.0)
    link.client()
    link.failed(TimeoutError("past its deadline: a frozen daemon"))
    assert link.down
    for _step in range(10):  # an engine's steps, every 0.1 s
        now[0] += 0.1
        with pytest.raises(LinkDownError) as refused:
            link.client()
        link.failed(refused.value)
    now[0] = 102.0
    assert not link.down and link.failures == 1
    assert link.client() is FakeClient.opened[-1]  # tried again on time


def test_a_daemon_that_keeps_failing_is_retried_less_and_less(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(link_module.time, "monotonic", lambda: now[0])
    link = new_link(retry_after_s=2.0)
    windows = []
    for _ in range(8):
        link.client()
        link.failed(TimeoutError("frozen"))
        start = now[0]
        while link.down:
            now[0] += 0.5
        windows.append(now[0] - start)
    assert windows == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    now[0] += 300.0  # healthy for a long while: the next failure starts over
    link.client()
    link.failed(TimeoutError("frozen again"))
    start = now[0]
    while link.down:
        now[0] += 0.5
    assert now[0] - start == 2.0


def test_an_absent_daemon_is_retried_as_often_as_ever(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused connection costs nothing: no back-off growth (a restarted daemon is found
    again within ``retry_after_s``)."""
    now = [100.0]
    monkeypatch.setattr(link_module.time, "monotonic", lambda: now[0])
    link = new_link(retry_after_s=2.0)
    FakeClient.refuse = UnavailableError("no socket")
    for _ in range(6):
        with pytest.raises(UnavailableError):
            link.client()
        start = now[0]
        while link.down:
            now[0] += 0.5
        assert now[0] - start == 2.0
