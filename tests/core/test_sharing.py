"""Requests sharing one decode loop (`feedback.core.sharing`): every run yields what it yields alone.

Most tests drive a `SharedDecoder(threaded=False)` turn by turn from the test thread, each run's
events read by a client thread of its own (a run joins the line when its first event is asked for),
so which run joins beside which, and when, is fixed. Every run is compared with the same run alone
(`run_with_logits`): the same tokens, the same raw logits at every step (to float rounding of the
batched kernels), the same stop reasons.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

import feedback.core.engine as engine
from feedback.core.engine import PrefillEvent, StepEvent, run_with_logits, start_run
from feedback.core.model import load_model
from feedback.core.records import DeepConfConfig, RowSpec, RunConfig
from feedback.core.sampling import SamplingConfig
from feedback.core.sharing import SharedDecoder, can_share, decoder_for, shared_events
from feedback.strategies import REGISTRY
from tests.tiny_families import write_folder

ATOL, RTOL = 1e-4, 1e-5  # batched vs alone; on the tiny model the worst seen is ~1e-5
# The real model: a padded batch's kernels round differently in the last bits, and a feedback row
# carries that into its next steps, the more the stronger it is (residual at alpha 0.6 reached 1.7e-4,
# at 0.2 8.2e-5: the cases below use 0.2, well inside the bound test_engine allows too).
REAL_ATOL = 2e-4
WAIT_S = 60  # a client thread that takes longer than this is stuck, not slow

SHORT = "Hi"
MEDIUM = "What is the capital of France?"
LONG = "The river runs to the sea. " * 8  # with the chat template: far longer than a running batch's cache

# Parameters at which every strategy visibly acts on the tiny random model.
STRATEGY_PARAMS = {
    "residual": {"alpha": 0.6, "source_layer": 3, "target_layer": 1},
    "soft_token": {"beta": 0.5},
    "deep_cache": {"lam": 0.5, "gate": -1.0, "theta": 20.0},
    "anchor": {"alpha": 0.5},
    "inner_loop": {"beta": 0.5},
    "restate": {"max_tokens": 3},
}
TINY_CASES = [(name, STRATEGY_PARAMS[name]) for name in REGISTRY] + [
    ("inner_loop+deep_cache", {"inner_loop.beta": 0.5, "deep_cache.lam": 0.5, "deep_cache.gate": -1.0}),
    ("inner_loop", {"mode": "euler", "loops": 1, "beta": 1.0}),
]
EMBEDDED_CASES = [("inner_loop", {"beta": 0.5}), ("residual", {"alpha": 0.2}), ("restate", {"max_tokens": 3})]


def test_every_registered_strategy_is_covered():
    """A strategy added to the registry must get parameters here, or the exactness cases skip it."""
    assert set(STRATEGY_PARAMS) == set(REGISTRY)


# ---- helpers ----


class Logits:
    """An observer keeping each row's raw logits at every step (as `run_with_logits` does)."""

    def __init__(self, log: list | None = None, name: str = ""):
        self.rows: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.log, self.name = log, name

    def __call__(self, step: int, live: list[int], logits: torch.Tensor) -> None:
        if self.log is not None:  # the order the loop stepped the runs in
            self.log.append((self.name, step))
        for pos, index in enumerate(live):
            self.rows[index].append(logits[pos].clone())


class Client:
    """A caller reading one run's events in a thread of its own, as a request's worker does.
    `hang_up_after`: it closes the iterator after that many events, once `go` is set."""

    def __init__(self, events, hang_up_after: int | None = None):
        self.iterator, self.hang_up_after = events, hang_up_after
        self.events: list = []
        self.error: BaseException | None = None
        self.reached, self.go = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._consume, daemon=True)

    def _consume(self) -> None:
        try:
            for event in self.iterator:
                self.events.append(event)
                if self.hang_up_after is not None and len(self.events) >= self.hang_up_after:
                    self.reached.set()
                    self.go.wait(WAIT_S)
                    self.iterator.close()  # the caller goes away mid-run
                    return
        except BaseException as exc:  # noqa: BLE001 (what the caller would see)
            self.error = exc

    def start(self) -> Client:
        self.thread.start()
        return self

    def join(self) -> None:
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "a client never got the end of its run"

    @property
    def steps(self) -> list[StepEvent]:
        return [e for e in self.events if isinstance(e, StepEvent)]


def _submit(
    decoder: SharedDecoder,
    lm,
    cfg: RunConfig,
    log: list | None = None,
    name: str = "",
    observer=None,
    prefill_events: bool = False,
    **kw,
):
    """The run of `cfg` handed to `decoder`, its client started and the run in the line to join."""
    seen = Logits(log, name)
    run = start_run(lm, cfg, observer=observer or seen)
    run.prefill_events = prefill_events
    waiting = decoder.status()["joining"]
    client = Client(decoder.submit(run), **kw).start()
    deadline = time.monotonic() + WAIT_S
    while decoder.status()["joining"] == waiting:  # queued once its first event is asked for
        assert time.monotonic() < deadline, "the run never joined the line"
        time.sleep(0.001)
    return SimpleNamespace(run=run, seen=seen, client=client)


def _turns(decoder: SharedDecoder, n: int) -> None:
    for _ in range(n):
        assert decoder.turn(), "the loop ran out of work too early"


def _drain(decoder: SharedDecoder, *shared) -> None:
    """Turns until the loop is idle; then every client has its run's end (after `Run._finish`)."""
    for _ in range(10_000):
        if not decoder.turn():
            break
    else:
        raise AssertionError("the loop never went idle")
    for s in shared:
        s.client.join()


_solo_cache: dict = {}


def _solo(lm, cfg: RunConfig):
    """The run alone: its result and each row's logits per step (cached: several tests reuse one)."""
    key = (lm.name, repr(cfg), engine.PREFILL_CHUNK)
    if key not in _solo_cache:
        _solo_cache[key] = run_with_logits(lm, cfg)
    return _solo_cache[key]


def _cfg(lm, prompt: str, n: int, strategy: str | None = None, params: dict | None = None, **kw) -> RunConfig:
    rows = [RowSpec("baseline")] + ([RowSpec("fb", strategy, params or {})] if strategy else [])
    return RunConfig(prompt=prompt, model=lm.name, max_new_tokens=n, rows=rows, **kw)


def _assert_exact(shared, solo, what: str = "") -> None:
    """The shared run gave, row by row, the tokens, stop reasons and logits the run gives alone."""
    result, logits = solo
    atol = ATOL if shared.run.lm.name == "tiny" else REAL_ATOL
    assert shared.client.error is None, f"{what}: {shared.client.error!r}"
    got = shared.run.result
    for i, row in enumerate(result.rows):
        mine = got.rows[i]
        assert mine.token_ids == row.token_ids, f"{what} row {row.name}: tokens differ from the run alone"
        assert mine.text == row.text
        assert (mine.stop_reason, mine.stop_step) == (row.stop_reason, row.stop_step), f"{what} {row.name}"
        assert len(shared.seen.rows[i]) == len(logits[i]), f"{what} row {row.name}: steps differ"
        for step, (a, b) in enumerate(zip(shared.seen.rows[i], logits[i], strict=True)):
            assert torch.allclose(a, b, atol=atol, rtol=RTOL), (
                f"{what} row {row.name} step {step}: logits differ by {(a - b).abs().max().item():.3g}"
            )
    # the events the client read are the result's steps (none lost, none doubled)
    steps = {
        i: [e.records[i].token_id for e in shared.client.steps if i in e.records]
        for i in range(len(got.rows))
    }
    assert steps == {i: r.token_ids for i, r in enumerate(got.rows)}


def _assert_acts(solo, what: str) -> None:
    """The strategy row differs from its baseline alone, so an exactness check of it can fail when
    the strategy's hooks do not act (or act on the wrong row) in the shared batch."""
    result, logits = solo
    if result.rows[0].token_ids != result.rows[1].token_ids:
        return
    worst = max((a - b).abs().max().item() for a, b in zip(logits[0], logits[1]))
    assert worst > 1e-3, f"{what}: the strategy does not change its row, so the test could not fail"


def _watch_joins(decoder: SharedDecoder) -> dict[int, tuple[int, int]]:
    """For each run that joins: (the batch's cache width just before, the run's own width)."""
    widths: dict[int, tuple[int, int]] = {}
    join = decoder._join

    def watched(member):
        before = decoder.batch.cache.get_seq_length() if decoder.batch.members else 0
        widths[id(member.run)] = (before, member.own.cache.get_seq_length())
        join(member)

    decoder._join = watched
    return widths


def _beside(decoder: SharedDecoder, run) -> int:
    """Rows already in the batch when `run` joined (fails if it never joined)."""
    (rows,) = [beside for rid, beside in decoder.joins if rid == id(run)]
    return rows


def _check_batch(decoder: SharedDecoder) -> None:
    """The batch's bookkeeping: one mask column per cache position, each row's unmasked positions
    are its real tokens, and no left padding common to every row (the longest row fills the cache)."""
    b = decoder.batch
    if not b.members:
        return
    assert b.mask.shape == (b.rows, b.cache.get_seq_length())
    assert torch.equal(b.mask.sum(dim=1), b.positions)
    assert b.mask.shape[1] == int(b.positions.max()), "common left padding was not cut"


# ---- 1. exactness: alone, starting in a batch, joining a running batch shorter or longer ----


def _scenario(lm, strategy: str, params: dict, sizes: dict, hook_count) -> None:
    """Runs of [baseline, strategy] (a) alone, (b) submitted with others of other prompt lengths
    before the loop starts, (c) joining a running batch whose cache is longer than their prompt, and
    one whose prompt is longer than the batch's cache (every running row, a looped strategy's own
    caches among them, re-padded on the left; cut again once that run leaves). The runs already in
    the batch stay exact too."""
    before_hooks = hook_count(lm.model)
    other = _cfg(lm, SHORT, sizes["other"])
    running = _cfg(lm, MEDIUM + " Tell me a story.", sizes["running"], "inner_loop", {"beta": 0.5})
    together = _cfg(lm, MEDIUM, sizes["together"], strategy, params)
    shorter = _cfg(lm, SHORT + " there", sizes["shorter"], strategy, params)
    longer = _cfg(lm, LONG, sizes["longer"], strategy, params)
    solo = {
        name: _solo(lm, c)
        for name, c in [
            ("other", other),
            ("running", running),
            ("together", together),
            ("shorter", shorter),
            ("longer", longer),
        ]
    }
    _assert_acts(solo["together"], strategy)

    decoder = SharedDecoder(lm, threaded=False)
    widths = _watch_joins(decoder)
    runs = {
        name: _submit(decoder, lm, c)
        for name, c in [("other", other), ("running", running), ("together", together)]
    }
    _turns(decoder, sizes["wait"])
    runs["shorter"] = _submit(decoder, lm, shorter)
    _turns(decoder, sizes["wait2"])
    runs["longer"] = _submit(decoder, lm, longer)
    for _ in range(10_000):
        _check_batch(decoder)
        if not decoder.turn():
            break
    _drain(decoder, *runs.values())

    assert _beside(decoder, runs["together"].run) >= 1
    for name in ("shorter", "longer"):
        assert _beside(decoder, runs[name].run) >= 2, f"{name} did not join a running batch"
    old, own = widths[id(runs["shorter"].run)]
    assert own < old, "the shorter prompt should join a batch with a longer cache"
    old, own = widths[id(runs["longer"].run)]
    assert own > old, "the longer prompt should re-pad the running rows"
    for name, shared in runs.items():
        _assert_exact(shared, solo[name], f"{strategy} {params} / {name}")
    assert hook_count(lm.model) == before_hooks


TINY_SIZES = dict(other=6, running=40, together=24, shorter=10, longer=4, wait=6, wait2=3)
EMBEDDED_SIZES = dict(other=3, running=16, together=12, shorter=6, longer=3, wait=3, wait2=2)


@pytest.mark.parametrize(
    "strategy, params", TINY_CASES, ids=[f"{n}-{p.get('mode', '')}" for n, p in TINY_CASES]
)
def test_a_shared_run_equals_it_alone_for_every_strategy(tiny_lm, hook_count, strategy, params):
    _scenario(tiny_lm, strategy, params, TINY_SIZES, hook_count)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, params", EMBEDDED_CASES, ids=[n for n, _ in EMBEDDED_CASES])
def test_a_shared_run_equals_it_alone_on_the_real_model(embedded_lm, hook_count, strategy, params):
    _scenario(embedded_lm, strategy, params, EMBEDDED_SIZES, hook_count)


# ---- 2. rows leaving ----


def test_rows_that_finish_leave_and_the_common_padding_is_cut(tiny_lm):
    """The longest prompt's run ends first: its rows leave and the left padding it put on every other
    row goes with it (a looped strategy's own caches shifted back too); the others stay exact."""
    cfgs = {
        "long": _cfg(tiny_lm, LONG, 3),
        "one": _cfg(tiny_lm, SHORT, 12),
        "two": _cfg(tiny_lm, MEDIUM, 10, "inner_loop", {"beta": 0.5}),
    }
    decoder = SharedDecoder(tiny_lm, threaded=False)
    runs = {
        name: _submit(decoder, tiny_lm, c)
        for name, c in [("one", cfgs["one"]), ("two", cfgs["two"]), ("long", cfgs["long"])]
    }
    widths, rows = [], []
    while decoder.turn():
        _check_batch(decoder)
        widths.append(decoder.batch.mask.shape[1] if decoder.batch.members else 0)
        rows.append(decoder.batch.rows)
    _drain(decoder, *runs.values())
    # turn 3: the long run joins (4 rows); turn 5: its last step, it leaves (3 rows)
    assert rows[:6] == [1, 3, 4, 4, 3, 3]
    long_width = len(runs["long"].run.prompt_ids)
    assert widths[2] == long_width and widths[3] == long_width + 1
    assert widths[4] < long_width - 10, "the long run's padding stayed after it left"
    assert widths[-1] == 0 and decoder.status() == {"shared_rows": 0, "shared_runs": 0, "joining": 0}
    for name, shared in runs.items():
        _assert_exact(shared, _solo(tiny_lm, cfgs[name]), name)


# ---- 3. each run's own settings in one step ----


def test_each_run_keeps_its_own_settings_in_shared_steps(tiny_lm):
    """Sampling (temperature, top-k, top-p, seed), repetition penalty, DeepConf window and threshold
    (one row stopping early), max new tokens and the chat template, all different per run, in the
    same forwards: each run equals itself alone, the seeded draws included."""
    cfgs = {
        "sampled": _cfg(
            tiny_lm,
            MEDIUM,
            10,
            "residual",
            {"alpha": 0.6},
            seed=3,
            sampling=SamplingConfig(temperature=0.9, top_k=20),
        ),
        "penalised": RunConfig(
            prompt=SHORT,
            model="tiny",
            max_new_tokens=8,
            chat_template=False,
            seed=11,
            sampling=SamplingConfig(temperature=0.7, top_p=0.9, repetition_penalty=1.3),
            rows=[
                RowSpec("baseline"),
                RowSpec("greedy", temperature=0.0),
                RowSpec("own seed", seed=5, top_p=0.5),
            ],
        ),
        "deepconf": RunConfig(
            prompt=LONG,
            model="tiny",
            max_new_tokens=14,
            deepconf=DeepConfConfig(window=3),
            rows=[RowSpec("baseline"), RowSpec("early", "anchor", {"alpha": 0.5}, threshold=1e9)],
        ),
    }
    solo = {name: _solo(tiny_lm, c) for name, c in cfgs.items()}
    greedy, _ = _solo(tiny_lm, _cfg(tiny_lm, MEDIUM, 10, "residual", {"alpha": 0.6}))
    assert solo["sampled"][0].rows[0].token_ids != greedy.rows[0].token_ids, "the sampled run does not sample"
    early = solo["deepconf"][0].rows[1]
    assert (early.stop_reason, len(early.token_ids)) == ("early_stop", 3)  # leaves its run's batch early

    decoder = SharedDecoder(tiny_lm, threaded=False)
    runs = {name: _submit(decoder, tiny_lm, c) for name, c in cfgs.items()}
    _drain(decoder, *runs.values())
    assert _beside(decoder, runs["penalised"].run) >= 2 and _beside(decoder, runs["deepconf"].run) >= 5
    for name, shared in runs.items():
        _assert_exact(shared, solo[name], name)


# ---- 4. stop and hang-up ----


def test_stop_and_hang_up_end_one_run_within_a_step_and_the_others_go_on(tiny_lm, hook_count):
    h0 = hook_count(tiny_lm.model)
    cfgs = {
        "kept": _cfg(tiny_lm, MEDIUM, 20, "inner_loop", {"beta": 0.5}),
        "stopped": _cfg(tiny_lm, SHORT, 20, "residual", {"alpha": 0.6}),
        "gone": _cfg(tiny_lm, SHORT + " there", 20, "deep_cache", {"lam": 0.5, "gate": -1.0}),
    }
    decoder = SharedDecoder(tiny_lm, threaded=False)
    runs = {name: _submit(decoder, tiny_lm, cfgs[name]) for name in ("kept", "stopped")}
    _turns(decoder, 2)
    h1 = hook_count(tiny_lm.model)
    runs["gone"] = _submit(decoder, tiny_lm, cfgs["gone"], hang_up_after=4)
    _turns(decoder, 6)  # "stopped" has decoded steps 0-6, "gone" steps 0-5
    assert hook_count(tiny_lm.model) > h1  # "gone" is attached

    runs["stopped"].run.stop()
    _turns(decoder, 1)
    runs["stopped"].client.join()  # it ended at this step, its last event delivered
    stopped = runs["stopped"].run.result
    assert [(r.stop_reason, r.stop_step, len(r.token_ids)) for r in stopped.rows] == [("stopped", 7, 8)] * 2
    alone, _ = _solo(tiny_lm, cfgs["stopped"])
    assert [r.token_ids for r in stopped.rows] == [r.token_ids[:8] for r in alone.rows]
    assert len(runs["stopped"].client.steps) == 8 and runs["stopped"].client.error is None

    # the caller of "gone" hangs up: its run stops, its hooks go, while the loop goes on
    assert runs["gone"].client.reached.wait(WAIT_S)
    hooks_before = hook_count(tiny_lm.model)
    runs["gone"].client.go.set()
    runs["gone"].client.join()  # closing drives the loop (threaded=False) until its run is let go
    assert all(not s._handles for s in runs["gone"].run.strategies.values())
    assert hook_count(tiny_lm.model) < hooks_before
    assert {r.stop_reason for r in runs["gone"].run.result.rows} == {"stopped"}
    assert decoder.status()["shared_runs"] == 1  # only "kept" is left

    _drain(decoder, *runs.values())
    _assert_exact(runs["kept"], _solo(tiny_lm, cfgs["kept"]), "kept")
    assert hook_count(tiny_lm.model) == h0


def test_a_run_stopped_before_it_joins_ends_without_a_token(tiny_lm, hook_count):
    h0 = hook_count(tiny_lm.model)
    decoder = SharedDecoder(tiny_lm, threaded=False)
    cfg = _cfg(tiny_lm, MEDIUM, 8, "residual", {"alpha": 0.6})
    kept = _submit(decoder, tiny_lm, cfg)
    waiting = _submit(decoder, tiny_lm, _cfg(tiny_lm, SHORT, 8, "inner_loop"))
    waiting.run.stop()
    _drain(decoder, kept, waiting)
    assert waiting.client.error is None and waiting.client.events == []
    assert {(r.stop_reason, len(r.token_ids)) for r in waiting.run.result.rows} == {("stopped", 0)}
    assert not any(rid == id(waiting.run) for rid, _ in decoder.joins)
    _assert_exact(kept, _solo(tiny_lm, cfg), "kept")
    assert hook_count(tiny_lm.model) == h0


# ---- 5. a long prompt joins a chunk per turn ----


def test_a_long_prompt_is_read_a_chunk_per_turn_while_the_others_decode(tiny_lm, monkeypatch, hook_count):
    monkeypatch.setattr(engine, "PREFILL_CHUNK", 8)
    h0 = hook_count(tiny_lm.model)
    running_cfg = _cfg(tiny_lm, SHORT, 24, "inner_loop", {"beta": 0.5})
    newcomer_cfg = _cfg(tiny_lm, LONG, 6, "inner_loop", {"beta": 0.5})
    decoder = SharedDecoder(tiny_lm, threaded=False)
    log: list = []
    running = _submit(decoder, tiny_lm, running_cfg, log, "running")
    while not log:  # its own prompt is read in chunks too: decoding once it has joined
        _turns(decoder, 1)
    mark = len(log)
    newcomer = _submit(decoder, tiny_lm, newcomer_cfg, log, "newcomer", prefill_events=True)
    run, client = newcomer.run, newcomer.client
    _drain(decoder, running, newcomer)

    chunks = -(-len(run.prompt_ids) // 8)
    assert chunks >= 8
    first = log.index(("newcomer", 0))
    between = [name for name, _ in log[mark:first]]
    assert between == ["running"] * len(between) and len(between) >= chunks - 1
    prefill = [e for e in client.events if isinstance(e, PrefillEvent)]
    assert [e.chunk for e in prefill] == list(range(1, chunks + 1))
    assert isinstance(client.events[chunks], StepEvent)  # every chunk reported before its first step
    assert _beside(decoder, run) == 2
    _assert_exact(newcomer, _solo(tiny_lm, newcomer_cfg), "newcomer")
    _assert_exact(running, _solo(tiny_lm, running_cfg), "running")
    assert hook_count(tiny_lm.model) == h0


def test_a_run_stopped_while_its_prompt_is_read_leaves_before_any_token(tiny_lm, monkeypatch, hook_count):
    monkeypatch.setattr(engine, "PREFILL_CHUNK", 8)
    h0 = hook_count(tiny_lm.model)
    decoder = SharedDecoder(tiny_lm, threaded=False)
    running_cfg = _cfg(tiny_lm, SHORT, 12)
    running = _submit(decoder, tiny_lm, running_cfg)
    while not decoder.batch.members:  # its own prompt is read in chunks too
        _turns(decoder, 1)
    reading = _submit(decoder, tiny_lm, _cfg(tiny_lm, LONG, 6, "inner_loop"))
    _turns(decoder, 3)  # three of its chunks read
    assert decoder.status()["joining"] == 1 and hook_count(tiny_lm.model) > h0
    reading.run.stop()
    _drain(decoder, running, reading)
    assert reading.client.error is None and reading.client.steps == []
    assert {(r.stop_reason, len(r.token_ids)) for r in reading.run.result.rows} == {("stopped", 0)}
    _assert_exact(running, _solo(tiny_lm, running_cfg), "running")
    assert hook_count(tiny_lm.model) == h0


# ---- 6. an error in one run ----


def test_an_error_in_one_run_fails_that_run_only(tiny_lm, hook_count):
    h0 = hook_count(tiny_lm.model)

    def failing_at(at: int):
        def observer(step, live, logits):
            if step == at:
                raise RuntimeError(f"observer failed at step {at}")

        return observer

    good_cfg = _cfg(tiny_lm, MEDIUM, 12, "inner_loop", {"beta": 0.5})
    after_cfg = _cfg(tiny_lm, LONG, 8, "soft_token", {"beta": 0.5})
    decoder = SharedDecoder(tiny_lm, threaded=False)
    good = _submit(decoder, tiny_lm, good_cfg)
    failed = {}
    for at in (0, 3):  # 0: as it joins; 3: in a shared step
        cfg = _cfg(tiny_lm, SHORT, 12, "residual", {"alpha": 0.6})
        failed[at] = _submit(decoder, tiny_lm, cfg, observer=failing_at(at)).client
    after = _submit(decoder, tiny_lm, after_cfg)  # joins after the failures
    _drain(decoder, good, after)
    for at, client in failed.items():
        client.join()
        assert isinstance(client.error, RuntimeError) and f"step {at}" in str(client.error)
        assert len(client.steps) == at
    _assert_exact(good, _solo(tiny_lm, good_cfg), "good")
    _assert_exact(after, _solo(tiny_lm, after_cfg), "after")
    assert hook_count(tiny_lm.model) == h0


# ---- 7. the loop in a thread of its own ----


def test_runs_read_from_threads_share_the_model_loop_and_it_ends_when_idle(tiny_lm, hook_count):
    h0 = hook_count(tiny_lm.model)
    decoder = decoder_for(tiny_lm)
    assert decoder_for(tiny_lm) is decoder and decoder.threaded
    cfgs = {
        "first": _cfg(tiny_lm, MEDIUM, 80, "inner_loop", {"beta": 0.5}),  # long: the others join beside it
        "second": _cfg(tiny_lm, SHORT, 12, "residual", {"alpha": 0.6}),
        "third": _cfg(tiny_lm, LONG, 10, "restate", {"max_tokens": 3}),
        "gone": _cfg(tiny_lm, SHORT, 30, "deep_cache", {"lam": 0.5, "gate": -1.0}),
    }
    solo = {name: _solo(tiny_lm, c) for name, c in cfgs.items()}
    runs = {}
    for name, c in cfgs.items():
        seen = Logits()
        run = start_run(tiny_lm, c, observer=seen)
        runs[name] = SimpleNamespace(
            run=run, seen=seen, client=Client(shared_events(run), hang_up_after=3 if name == "gone" else None)
        )
    runs["gone"].client.go.set()
    runs["first"].client.start()
    deadline = time.monotonic() + WAIT_S
    while not runs["first"].client.events:  # the others start while the first decodes
        assert time.monotonic() < deadline
        time.sleep(0.001)
    loop = decoder._thread
    assert loop is not None and loop.is_alive()
    for name in ("second", "third", "gone"):
        runs[name].client.start()
    for shared in runs.values():
        shared.client.join()

    loop.join(WAIT_S)
    assert not loop.is_alive() and decoder._thread is None  # the loop thread went once idle
    for name in ("second", "third"):
        assert _beside(decoder, runs[name].run) >= 1
        _assert_exact(runs[name], solo[name], name)
    _assert_exact(runs["first"], solo["first"], "first")
    assert {r.stop_reason for r in runs["gone"].run.result.rows} == {"stopped"}
    assert hook_count(tiny_lm.model) == h0
    # the loop starts again for the next run
    again = start_run(tiny_lm, cfgs["second"])
    steps = max(len(r.token_ids) for r in solo["second"][0].rows)
    assert [e.step for e in shared_events(again)] == list(range(steps))
    assert again.result.rows[1].token_ids == solo["second"][0].rows[1].token_ids


# ---- 8. quality metrics ----


def test_quality_metrics_of_a_shared_run_equal_the_run_alone(tiny_lm):
    cfg = RunConfig(
        prompt=MEDIUM,
        model="tiny",
        max_new_tokens=8,
        quality=True,
        reference="Paris is the capital of France.",
        key_facts=["Paris", "France"],
        rows=[
            RowSpec("baseline"),
            RowSpec("fb", "residual", {"alpha": 0.6}),
            RowSpec("restated", "restate", {"max_tokens": 2}),
        ],
    )
    other_cfg = _cfg(tiny_lm, LONG, 12, "inner_loop")
    alone, _ = _solo(tiny_lm, cfg)
    decoder = SharedDecoder(tiny_lm, threaded=False)
    other = _submit(decoder, tiny_lm, other_cfg)
    _turns(decoder, 2)
    shared = _submit(decoder, tiny_lm, cfg)
    _drain(decoder, other, shared)
    assert _beside(decoder, shared.run) == 2
    for mine, row in zip(shared.run.result.rows, alone.rows, strict=True):
        assert mine.token_ids == row.token_ids
        for key in ("self_ppl", "prompt_ppl", "reference_ppl"):
            assert row.metrics[key] is not None, (row.name, key)
        assert set(mine.metrics) == set(row.metrics)
        for key, value in row.metrics.items():
            if isinstance(value, float):
                assert mine.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (row.name, key)
            else:
                assert mine.metrics[key] == value, (row.name, key)
    _assert_exact(other, _solo(tiny_lm, other_cfg), "other")


# ---- 9. a model whose runs cannot share ----


def test_a_model_with_sliding_window_layers_runs_each_request_alone(embedded_lm, tmp_path, hook_count):
    lm = load_model(
        f"random:{write_folder('gemma2', embedded_lm.tokenizer, tmp_path / 'gemma2')}", dtype="float32"
    )
    assert not can_share(lm)
    cfg = _cfg(lm, LONG, 8, "inner_loop", {"beta": 0.5})
    alone, _ = run_with_logits(lm, cfg)
    runs = [start_run(lm, cfg) for _ in range(2)]
    events = [shared_events(run) for run in runs]
    live = list(events)
    while live:  # read side by side: each iterates alone
        for it in list(live):
            if next(it, None) is None:
                live.remove(it)
    assert lm.decoder is None  # no shared loop was made for it
    for run in runs:
        assert [r.token_ids for r in run.result.rows] == [r.token_ids for r in alone.rows]
    assert hook_count(lm.model) == 0


def test_a_sliding_window_kept_by_the_mask_alone_shares_exactly(embedded_lm, tmp_path):
    """Mistral's window is a mask over a full cache (no sliding layers): its runs share, and a prompt
    longer than the window joining a running batch (re-padding it) leaves every row exact."""
    lm = load_model(
        f"random:{write_folder('mistral', embedded_lm.tokenizer, tmp_path / 'mistral')}", dtype="float32"
    )
    assert can_share(lm) and lm.model.config.sliding_window < len(lm.encode(LONG))
    cfgs = {"running": _cfg(lm, SHORT, 16), "longer": _cfg(lm, LONG, 6)}
    decoder = SharedDecoder(lm, threaded=False)
    widths = _watch_joins(decoder)
    running = _submit(decoder, lm, cfgs["running"])
    _turns(decoder, 4)
    longer = _submit(decoder, lm, cfgs["longer"])
    _drain(decoder, running, longer)
    old, own = widths[id(longer.run)]
    assert own > old and _beside(decoder, longer.run) == 1
    _assert_exact(running, _solo(lm, cfgs["running"]), "running")
    _assert_exact(longer, _solo(lm, cfgs["longer"]), "longer")


# ---- the loop's own bookkeeping ----


def test_a_run_stopped_before_it_joins_reports_its_own_wall_time(tiny_lm):
    decoder = SharedDecoder(tiny_lm, threaded=False)
    kept = _submit(decoder, tiny_lm, _cfg(tiny_lm, SHORT, 4))
    waiting = _submit(decoder, tiny_lm, _cfg(tiny_lm, SHORT, 4))
    waiting.run.stop()
    _drain(decoder, kept, waiting)
    # it lived no longer than the run beside it (it reports seconds since the clock's zero instead)
    assert waiting.run.result.wall_seconds <= kept.run.result.wall_seconds + 5


def test_padding_left_by_a_row_that_ends_before_its_run_joins_is_cut(tiny_lm):
    eos = tiny_lm.eos_token_ids[0]
    rows = [RowSpec("long", prompt=LONG, prefix=[eos]), RowSpec("short", prompt=SHORT)]
    decoder = SharedDecoder(tiny_lm, threaded=False)
    shared = _submit(decoder, tiny_lm, RunConfig(prompt="", model="tiny", max_new_tokens=4, rows=rows))
    try:
        _turns(decoder, 1)  # it joins with its short row only
        _check_batch(decoder)
    finally:
        _drain(decoder, shared)


def test_a_failure_while_stacking_caches_ends_only_the_runs_it_touched(tiny_lm, monkeypatch, hook_count):
    """Out of memory while a run joins (its cache stacked with the batch's) fails that run alone;
    one while the batch is re-cut after a row leaves fails the runs in the batch. Either way the
    model's loop goes on: no caller hangs, no hook stays, and a later run decodes exactly."""
    import feedback.core.sharing as sharing

    real, calls = sharing.stack_rows, []

    def failing(parts, room):
        calls.append(len(parts))
        if len(calls) == 2:  # the second join
            raise MemoryError("no room for the stacked cache")
        return real(parts, room)

    monkeypatch.setattr(sharing, "stack_rows", failing)
    decoder = SharedDecoder(tiny_lm, threaded=False)
    cfg = _cfg(tiny_lm, LONG, 8, "inner_loop", {"beta": 0.5})
    running = _submit(decoder, tiny_lm, cfg)
    _turns(decoder, 2)
    joining = _submit(decoder, tiny_lm, _cfg(tiny_lm, SHORT, 6))
    _drain(decoder, running, joining)
    assert isinstance(joining.client.error, MemoryError)
    _assert_exact(running, _solo(tiny_lm, cfg), "running")

    # in the loop's thread: a failure outside any one run's work ends the runs in the batch, and the
    # loop thread lives on for the next
    calls.clear()
    monkeypatch.setattr(sharing, "stack_rows", real)
    threaded = SharedDecoder(tiny_lm)
    monkeypatch.setattr(threaded, "_select", lambda kept: (_ for _ in ()).throw(MemoryError("cut")))
    runs = [start_run(tiny_lm, _cfg(tiny_lm, SHORT, n)) for n in (64, 3)]
    errors, decoding = [], threading.Event()

    def read(run):
        try:
            for _ in threaded.submit(run):
                decoding.set()
        except MemoryError as exc:
            errors.append(exc)
        finally:
            decoding.set()

    # the short run joins once the long one is decoding, so the two share the batch and the short
    # one's leaving re-cuts it (started at once, the short one could end before the long one began)
    readers = [threading.Thread(target=read, args=(run,)) for run in runs]
    readers[0].start()
    assert decoding.wait(WAIT_S)
    readers[1].start()
    for t in readers:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in readers) and len(errors) >= 1
    monkeypatch.undo()
    later = start_run(tiny_lm, _cfg(tiny_lm, SHORT, 4))
    list(threaded.submit(later))
    assert later.result.rows[0].token_ids == _solo(tiny_lm, _cfg(tiny_lm, SHORT, 4))[0].rows[0].token_ids
    deadline = time.monotonic() + WAIT_S
    while threaded._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threaded._thread is None and hook_count(tiny_lm.model) == 0


def test_closing_the_loop_stops_its_runs_and_waits_for_its_thread(tiny_lm):
    """What the process does at exit (an atexit hook closes every loop): a daemon loop thread left
    inside PyTorch while the interpreter finalizes can abort the process."""
    decoder = SharedDecoder(tiny_lm)  # threaded, as served
    events = decoder.submit(start_run(tiny_lm, _cfg(tiny_lm, MEDIUM, 400, "residual", {"alpha": 0.6})))
    first = next(events)
    assert first is not None and decoder._thread is not None and decoder._thread.is_alive()
    thread = decoder._thread
    decoder.close(timeout=WAIT_S)
    assert not thread.is_alive()
    rest = list(events)  # the run ended within a step, its caller told so
    assert len(rest) < 400
    from feedback.core import sharing

    assert decoder in sharing._LOOPS
