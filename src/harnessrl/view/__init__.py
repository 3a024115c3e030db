"""The seen-vs-trained viewer of a run directory (`harnessrl view`).

`index.py` scans `rollouts.jsonl` once into byte offsets and a small summary per rollout;
`detail.py` rebuilds one rollout's training rows with the samples builder and the run's own
tokenizer, on demand; `report.py` writes a self-contained HTML report; `server.py` serves the
same page and the per-rollout JSON on loopback.
"""
