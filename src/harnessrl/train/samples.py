"""The samples builder: one rollout's recorded turns -> training rows (DESIGN.md §5).

Responsibility: decide which recorded turns are the agent's own, and merge them into rows of
`input_ids`, `completion_mask`, `sampler_logprobs` and `policy_versions` by token prefixes.

Which turns train (in this order):
  1. Only `status="ok"` turns that pass `check_turn_faithful` are eligible; `error` and
     `unfaithful` turns are excluded with their reason in `MergeStats.excluded`.
  2. Retries: an eligible turn whose `prompt_ids` equal those of a *later* eligible turn is a
     superseded retry (the agent used the later answer) and is excluded
     (`retry_superseded`). Exact duplicates therefore train once, as the later turn.
  3. Agent versus auxiliary turns (titles, summaries, compaction), decided structurally:
     * Chains. Turns are taken in arrival order; turn j *continues* an earlier eligible
       turn i when `prompt_i` is a prefix of `prompt_j` (j's conversation contains all of
       i's prompt; the divergence, if any, lies inside i's completion or after it). Its
       parent is the candidate with the longest common prefix between `prompt_j` and
       `prompt_i + completion_i` (latest turn on ties). A turn with no parent starts a
       new chain. A chain is a tree of turns under one root.
     * Main chains. The final turn is the last eligible turn not labelled auxiliary (below).
       Its chain is main, and so is
       every chain whose root prompt shares at least `main_prefix_tokens` leading tokens
       with the final chain's root prompt (the agent's system prompt and task survive a
       compaction; a title or summariser call has its own system prompt and does not).
     * A turn whose agent labelled it as auxiliary (`Turn.request_kind` containing one of
       `AUXILIARY_KIND_MARKERS`: compact, title, summar) is auxiliary whatever its chain; any
       other label (or none) leaves the structural decision alone, so an unknown label never
       stops the agent's own turns from training.
     * `agent_turn_fn(turns) -> turns`, when given, replaces the structural rule: it gets
       the eligible turns in order and returns the agent's turns (matched by `turn_index`).
     Auxiliary turns are counted and not trained unless `train_auxiliary=True`.
     Known limit: a summary request appended to the agent's own history, without a
     `request_kind` label, is indistinguishable by tokens from a user follow-up; it is main.
     And an unlabelled auxiliary call that arrives after the agent's last turn becomes the
     final turn (harnesses we know issue titles early and summaries with a label).
  4. `train_turn_fn(turn) -> bool` rejects a turn from training: its completion stays in
     the row as context (mask 0).

Merging (DESIGN.md §5). Each turn is merged into the row holding its parent's tokens:
  * CLEAN: `prompt_ids` starts with the row's tokens: append the prompt tail (mask 0), then
    the completion (mask 1, sampler logprobs, the turn's policy version).
  * REALIGN: the divergence starts inside the row's last completion and no trained token lies
    after it (that completion was kept as context by `train_turn_fn`): overwrite from the
    divergence (mask 0), append.
  * FORK: otherwise, or for the root of a later chain: the row ends at the previous turn
    (its completion stays trained) and a new row starts whose prompt is context.
  With bridged rendering (`chat/layer.py`) an agent's next prompt starts with the exact ids
  of its previous turn, so its turns merge CLEAN; REALIGN and FORK remain for prompts that
  re-render history (compaction, rewritten messages, sub-agents, templates bridging misses).

Accounting (`MergeStats`, logged each step as `samples/*`, DESIGN.md §5): rows per rollout; the
CLEAN / REALIGN / FORK counts of the main-chain turns after a rollout's first, and of the CLEAN
ones those whose prompt the chat layer bridged (the turn notes `bridged_from=N`); and the
trained tokens of the kept rows by the position of the agent turn whose completion they are
(the k-th main-chain turn of its rollout, 1-based; positions past `TURN_POSITIONS` share the
last bucket).

Invariants: every main-chain sampled token trains in exactly one row (accepted by
`train_turn_fn`; `MergeStats.untrained_sampled_tokens` counts any that do not, and is 0 by
construction: no merge ever turns a trained token into context); a trained token's id and
logprob are exactly the engine's (no re-tokenisation); rows with no trained token are
dropped; the logprob at index t is that of `input_ids[t]` given `input_ids[:t]`.

What this module does not do: stamp advantages (see `advantages.py`), pack rows, or read
rewards. Prefix comparisons are C-speed list-slice comparisons with a bisection for the
divergence point; there is no per-token Python loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from harnessrl.types import Rollout, Row, Turn, check_turn_faithful

MergeKind = Literal["clean", "realign", "fork"]
AUXILIARY_KIND_MARKERS = ("compact", "title", "summar")
"""Substrings of a lower-cased `Turn.request_kind` that mark a call as auxiliary."""
AgentTurnFn = Callable[[list[Turn]], list[Turn]]
TrainTurnFn = Callable[[Turn], bool]
TURN_POSITIONS = 4
"""Turn-position buckets of `MergeStats.trained_by_turn`: 1, 2, 3, and 4 for every later turn."""
BRIDGED_NOTE = "bridged_from="
"""Prefix of the `Turn.notes` entry the proxy writes for a bridged prompt (`chat/bridging.py`)."""


@dataclass(slots=True)
class MergeStats:
    """Counts from building rows of one or more rollouts; `merge` adds two together.

    Fractions are over merged turns of main chains that follow the first one of their
    rollout (the first turn starts a row and is neither CLEAN, REALIGN nor FORK).
    """

    num_rollouts: int = 0
    """Rollouts built (one per `build_rows` call), whatever their rows."""

    num_clean: int = 0
    num_realign: int = 0
    num_fork: int = 0
    num_bridged: int = 0
    """Of `num_clean`, the merges whose prompt the chat layer bridged: the turn notes
    `bridged_from=N` (its prompt starts with an earlier turn's exact prompt + completion ids),
    as opposed to a re-rendered history that happened to reproduce the row's ids."""
    num_turns: int = 0
    """Recorded turns seen, all kinds."""
    num_auxiliary: int = 0
    """Eligible turns classified as auxiliary (trained only with `train_auxiliary`)."""
    num_rejected_by_hook: int = 0
    """Turns `train_turn_fn` kept as context only."""
    num_rows: int = 0
    num_dropped_rows: int = 0
    """Rows built with no trained token (dropped)."""
    tokens_trained: int = 0
    main_sampled_tokens: int = 0
    """Sampled tokens of main-chain turns accepted by `train_turn_fn` (all should train)."""
    untrained_sampled_tokens: int = 0
    """Of `main_sampled_tokens`, those that train in no kept row (goal and invariant: 0)."""
    tokens_total: int = 0
    """Tokens in the kept rows (trained + context)."""
    excluded: Counter[str] = field(default_factory=Counter)
    """Turns never trained nor merged, by reason: `error`, `unfaithful`, `retry_superseded`."""
    trained_by_turn: Counter[int] = field(default_factory=Counter)
    """Trained tokens of the kept rows by turn position: key k (1..`TURN_POSITIONS`) counts the
    trained tokens whose completion is the k-th main-chain turn of its rollout (eligible turns
    in arrival order, those `train_turn_fn` rejected included), the last key every later turn
    too. Auxiliary turns (trained only with `train_auxiliary`) are in no bucket."""

    def merge(self, other: MergeStats) -> MergeStats:
        """Return the element-wise sum of `self` and `other` (neither is modified)."""
        return MergeStats(
            num_rollouts=self.num_rollouts + other.num_rollouts,
            num_clean=self.num_clean + other.num_clean,
            num_realign=self.num_realign + other.num_realign,
            num_fork=self.num_fork + other.num_fork,
            num_bridged=self.num_bridged + other.num_bridged,
            num_turns=self.num_turns + other.num_turns,
            num_auxiliary=self.num_auxiliary + other.num_auxiliary,
            num_rejected_by_hook=self.num_rejected_by_hook + other.num_rejected_by_hook,
            num_rows=self.num_rows + other.num_rows,
            num_dropped_rows=self.num_dropped_rows + other.num_dropped_rows,
            tokens_trained=self.tokens_trained + other.tokens_trained,
            main_sampled_tokens=self.main_sampled_tokens + other.main_sampled_tokens,
            untrained_sampled_tokens=self.untrained_sampled_tokens + other.untrained_sampled_tokens,
            tokens_total=self.tokens_total + other.tokens_total,
            excluded=self.excluded + other.excluded,
            trained_by_turn=self.trained_by_turn + other.trained_by_turn,
        )

    def fractions(self) -> dict[str, float]:
        """`{"clean": f, "realign": f, "fork": f}` over merged turns; zeros when none."""
        n = self.num_clean + self.num_realign + self.num_fork
        if n == 0:
            return {"clean": 0.0, "realign": 0.0, "fork": 0.0}
        return {"clean": self.num_clean / n, "realign": self.num_realign / n, "fork": self.num_fork / n}

    def rows_per_rollout(self) -> float:
        """Kept rows per rollout built (`num_rows / num_rollouts`); 0.0 when none was built.
        1.0 when every rollout trains as one row (all merges CLEAN), more with each FORK."""
        return self.num_rows / self.num_rollouts if self.num_rollouts else 0.0

    def frac_bridged(self) -> float:
        """Share of merged turns (the `fractions` denominator) that are CLEAN and bridged;
        at most `fractions()["clean"]`. 0.0 when no turn was merged."""
        n = self.num_clean + self.num_realign + self.num_fork
        return self.num_bridged / n if n else 0.0

    def turn_shares(self) -> dict[str, float]:
        """`{"turn_1": s, ..., "turn_4plus": s}`: each turn position's share of the main-chain
        trained tokens (`trained_by_turn`, buckets of `TURN_POSITIONS`); they sum to 1, or are
        all 0.0 when no main-chain token trained."""
        total = sum(self.trained_by_turn.values())
        names = [f"turn_{k}" for k in range(1, TURN_POSITIONS)] + [f"turn_{TURN_POSITIONS}plus"]
        return {name: (self.trained_by_turn[k] / total if total else 0.0)
                for k, name in enumerate(names, start=1)}

    def as_metrics(self, prefix: str = "samples/") -> dict[str, float]:
        """Flat metrics for a `MetricsSink`: fractions (`frac_clean`, `frac_realign`,
        `frac_fork`, `frac_bridged`), `rows_per_rollout`, `trained_token_share/turn_<k>`
        (`turn_shares`), counts, and `excluded/<reason>`."""
        out = {f"{prefix}frac_{k}": v for k, v in self.fractions().items()}
        out[prefix + "frac_bridged"] = self.frac_bridged()
        out[prefix + "rows_per_rollout"] = self.rows_per_rollout()
        out.update({f"{prefix}trained_token_share/{k}": v for k, v in self.turn_shares().items()})
        for name in ("num_rollouts", "num_clean", "num_realign", "num_fork", "num_bridged", "num_turns", "num_auxiliary", "num_rejected_by_hook", "num_rows",
                     "num_dropped_rows", "tokens_trained", "main_sampled_tokens",
                     "untrained_sampled_tokens", "tokens_total"):
            out[prefix + name] = float(getattr(self, name))
        for reason, count in sorted(self.excluded.items()):
            out[f"{prefix}excluded/{reason}"] = float(count)
        return out


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id lists.

    Compares list slices (C-speed) and bisects the first mismatch, so the total work is
    O(len) element comparisons with O(log len) Python steps.
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _starts_with(seq: Sequence[int], prefix: Sequence[int]) -> bool:
    n = len(prefix)
    if n > len(seq) or (n and seq[n - 1] != prefix[-1]):  # cheap rejection first
        return False
    return seq[:n] == prefix


@dataclass(slots=True)
class _RowBuilder:
    """Mutable row under construction (lists, extended in C)."""

    tokens: list[int]
    mask: list[int]
    logprobs: list[float]
    versions: list[int]
    last_completion_start: int = 0
    last_turn: int = -1
    """Index of the turn whose completion ends the row: then `tokens == prompt + completion`
    of that turn, so its children's prefix match (from `_parents_and_matches`) applies."""
    main_spans: list[tuple[int, int, int]] = field(default_factory=list)
    """(start, length, turn position) of each trained main-chain completion appended (for
    accounting; the position is 1-based among the rollout's main-chain turns)."""
    divergences: list[tuple[int, int]] = field(default_factory=list)
    """`Row.divergences`: (turn_index, first differing position) of each REALIGN / FORK."""

    @classmethod
    def from_context(cls, prompt_ids: list[int]) -> _RowBuilder:
        n = len(prompt_ids)
        return cls(list(prompt_ids), [0] * n, [0.0] * n, [-1] * n, n)

    def truncate(self, n: int) -> None:
        del self.tokens[n:], self.mask[n:], self.logprobs[n:], self.versions[n:]
        self.main_spans = [(s, min(k, n - s), pos) for s, k, pos in self.main_spans if s < n]

    def append_context(self, ids: Sequence[int]) -> None:
        k = len(ids)
        self.tokens.extend(ids)
        self.mask.extend([0] * k)
        self.logprobs.extend([0.0] * k)
        self.versions.extend([-1] * k)

    def append_completion(self, turn: Turn, trained: bool, position: int = 0) -> None:
        """Append `turn`'s completion, trained or as context; `position` is the turn's 1-based
        place among its rollout's main-chain turns, 0 for an auxiliary turn."""
        self.last_completion_start = len(self.tokens)
        if trained and position:
            self.main_spans.append((len(self.tokens), len(turn.completion_ids), position))
        if not trained:
            self.append_context(turn.completion_ids)
            return
        k = len(turn.completion_ids)
        self.tokens.extend(turn.completion_ids)
        self.mask.extend([1] * k)
        self.logprobs.extend(turn.completion_logprobs)
        self.versions.extend([turn.policy_version] * k)


def _merge_turn(builder: _RowBuilder, turn: Turn, known_match: int) -> tuple[MergeKind, _RowBuilder]:
    """Merge `turn`'s prompt into `builder`; return (kind, the row to append to).

    `known_match` is the common prefix length of `turn.prompt_ids` and `builder.tokens` when
    already known, else -1. The returned row is `builder` (CLEAN, REALIGN) or a new row
    (FORK). A REALIGN never overwrites a trained token. A REALIGN or FORK notes
    `(turn.turn_index, first differing position)` in the returned row's `divergences`.
    """
    prompt = turn.prompt_ids
    n_row = len(builder.tokens)
    matched = known_match if known_match >= 0 else common_prefix_len(builder.tokens, prompt)
    if matched == n_row:
        builder.append_context(prompt[n_row:])
        return "clean", builder
    if matched >= builder.last_completion_start and not any(builder.mask[matched:]):
        builder.truncate(matched)
        builder.append_context(prompt[matched:])
        builder.divergences.append((turn.turn_index, matched))
        return "realign", builder
    forked = _RowBuilder.from_context(prompt)
    forked.divergences.append((turn.turn_index, matched))
    return "fork", forked


def _eligible_turns(turns: Sequence[Turn], stats: MergeStats) -> list[Turn]:
    """Drop error, unfaithful and superseded-retry turns, counting each reason."""
    ok: list[Turn] = []
    for turn in turns:
        if turn.status != "ok":
            stats.excluded[turn.status] += 1
        elif check_turn_faithful(turn) is not None:
            stats.excluded["unfaithful"] += 1
        else:
            ok.append(turn)
    superseded = _superseded_retries(ok)
    kept = [t for i, t in enumerate(ok) if i not in superseded]
    if len(kept) < len(ok):
        stats.excluded["retry_superseded"] += len(ok) - len(kept)
    return kept


def _superseded_retries(turns: Sequence[Turn]) -> set[int]:
    """Indices of turns whose exact `prompt_ids` a later turn repeats.

    Bucketed by a cheap key (length and 32 sampled ids), compared exactly inside a bucket,
    so a trace costs one key per turn rather than hashing every prompt in full.
    """
    buckets: dict[tuple[int, ...], list[int]] = {}
    for i, turn in enumerate(turns):
        p = turn.prompt_ids
        key = (len(p), *p[:: max(1, len(p) // 32)], *p[-8:])
        buckets.setdefault(key, []).append(i)
    superseded: set[int] = set()
    for members in buckets.values():
        for pos, i in enumerate(members):
            if any(turns[i].prompt_ids == turns[k].prompt_ids for k in members[pos + 1:]):
                superseded.add(i)
    return superseded


def find_parents(turns: Sequence[Turn]) -> list[int | None]:
    """Parent index of each turn in the chain forest (module docstring, rule 3).

    `parents[j]` is the index i < j of the turn j continues, or None for a chain root.
    """
    return _parents_and_matches(turns)[0]


def _parents_and_matches(turns: Sequence[Turn]) -> tuple[list[int | None], list[int]]:
    """Parents, and for each turn with a parent i the length of the common prefix of its
    prompt with `prompt_i + completion_i` (-1 for roots)."""
    parents: list[int | None] = []
    matches: list[int] = []
    for j, turn in enumerate(turns):
        prompt = turn.prompt_ids
        best, best_len = None, -1
        for i in range(j - 1, -1, -1):
            prev_p, prev_c = turns[i].prompt_ids, turns[i].completion_ids
            # An earlier candidate cannot beat the best match if its whole text is not longer
            # (ties go to the later turn); this keeps a linear chain O(turns) comparisons.
            n_prev = len(prev_p)
            if n_prev + len(prev_c) <= best_len or not _starts_with(prompt, prev_p):
                continue
            n = n_prev + common_prefix_len(prev_c, prompt[n_prev:n_prev + len(prev_c)])
            if n > best_len:
                best, best_len = i, n
        parents.append(best)
        matches.append(best_len)
    return parents, matches


def _root_of(parents: Sequence[int | None], j: int) -> int:
    while (p := parents[j]) is not None:
        j = p
    return j


def classify_main(
    turns: Sequence[Turn], parents: Sequence[int | None], main_prefix_tokens: int
) -> list[bool]:
    """Whether each turn is the agent's own (main chains) rather than auxiliary.

    Rule 3 of the module docstring: the final turn's chain is main, and so is every chain
    whose root prompt shares >= `main_prefix_tokens` leading tokens with its root prompt;
    a turn whose `request_kind` holds an `AUXILIARY_KIND_MARKERS` substring is auxiliary.
    """
    if not turns:
        return []
    roots = [_root_of(parents, j) for j in range(len(turns))]
    unlabelled = [j for j in range(len(turns)) if not _labelled_auxiliary(turns[j])]
    final_root = roots[unlabelled[-1] if unlabelled else len(turns) - 1]
    final_root_prompt = turns[final_root].prompt_ids
    main_root: dict[int, bool] = {}
    for r in set(roots):
        shared = common_prefix_len(turns[r].prompt_ids, final_root_prompt)
        main_root[r] = r == final_root or shared >= main_prefix_tokens
    return [main_root[roots[j]] and not _labelled_auxiliary(turns[j]) for j in range(len(turns))]


def _labelled_auxiliary(turn: Turn) -> bool:
    kind = (turn.request_kind or "").lower()
    return any(marker in kind for marker in AUXILIARY_KIND_MARKERS)


def build_rows(
    rollout: Rollout,
    *,
    train_turn_fn: TrainTurnFn | None = None,
    agent_turn_fn: AgentTurnFn | None = None,
    train_auxiliary: bool = False,
    main_prefix_tokens: int = 32,
) -> tuple[list[Row], MergeStats]:
    """Build the training rows of one rollout (module docstring for the rules).

    Rows carry the rollout's `rollout_id` and `group_id` and `advantage=0.0` (stamped later).

    Returns:
        (rows in order of creation, stats). Rows hold >= 1 trained token each.
    """
    stats = MergeStats(num_rollouts=1, num_turns=len(rollout.trace.turns))
    eligible = _eligible_turns(rollout.trace.turns, stats)
    parents, matches = _parents_and_matches(eligible)
    if agent_turn_fn is None:
        is_main = classify_main(eligible, parents, main_prefix_tokens)
    else:
        chosen = {t.turn_index for t in agent_turn_fn(list(eligible))}
        is_main = [t.turn_index in chosen for t in eligible]
    stats.num_auxiliary = is_main.count(False)
    builders: list[_RowBuilder] = []
    builder_of: list[_RowBuilder | None] = [None] * len(eligible)
    position = 0  # of the current turn among the main-chain ones, 1-based
    for j, turn in enumerate(eligible):
        if not (is_main[j] or train_auxiliary):
            continue
        parent = parents[j]
        parent_row = builder_of[parent] if parent is not None else None
        if parent_row is None:
            row, kind = _RowBuilder.from_context(turn.prompt_ids), "fork"
            builders.append(row)
        else:
            known = matches[j] if parent_row.last_turn == parent else -1
            kind, row = _merge_turn(parent_row, turn, known)
            if row is not parent_row:
                builders.append(row)
        if is_main[j]:
            if position:
                setattr(stats, f"num_{kind}", getattr(stats, f"num_{kind}") + 1)
                stats.num_bridged += kind == "clean" and _bridged(turn)
            position += 1
        trained = train_turn_fn is None or bool(train_turn_fn(turn))
        stats.num_rejected_by_hook += not trained
        if trained and is_main[j]:
            stats.main_sampled_tokens += len(turn.completion_ids)
        row.append_completion(turn, trained, position if is_main[j] else 0)
        row.last_turn, builder_of[j] = j, row
    return _finish_rows(builders, rollout, stats), stats


def _bridged(turn: Turn) -> bool:
    return any(note.startswith(BRIDGED_NOTE) for note in turn.notes)


def _finish_rows(builders: list[_RowBuilder], rollout: Rollout, stats: MergeStats) -> list[Row]:
    rows: list[Row] = []
    trained_main = 0
    for b in builders:
        n_trained = sum(b.mask)
        if n_trained == 0:
            stats.num_dropped_rows += 1
            continue
        for s, k, pos in b.main_spans:
            n = sum(b.mask[s:s + k])
            trained_main += n
            stats.trained_by_turn[min(pos, TURN_POSITIONS)] += n
        stats.tokens_trained += n_trained
        stats.tokens_total += len(b.tokens)
        rows.append(
            Row(
                input_ids=tuple(b.tokens),
                completion_mask=tuple(b.mask),
                sampler_logprobs=tuple(b.logprobs),
                policy_versions=tuple(b.versions),
                rollout_id=rollout.rollout_id,
                group_id=rollout.group_id,
                divergences=tuple(b.divergences),
            )
        )
    stats.num_rows += len(rows)
    stats.untrained_sampled_tokens += stats.main_sampled_tokens - trained_main
    return rows
