#!/usr/bin/env bash
# Issue 48's experiment as one background queue that survives a lost machine.
#
#   nohup nice -n 10 setsid bash experiments/reasoning_queue.sh > /dev/null 2>&1 &
#
# Runs the untrained evaluations, then every (arm, seed) in seed-major order, each under a time limit
# (a stopped run resumes from its checkpoint the next time). Work folders are in OUT; checkpoints are
# ~150 MB a run and stay there. After each job the records the report needs (untrained/<arm>.json and
# each finished run's config.json, experiment.json, metrics.jsonl) are copied to KEEP, which is
# committed (docs/data/reasoning_learning): the machine and OUT can be lost between sessions, and on
# 2026-11-29 they were. At the start, records in KEEP that OUT lacks are copied back, so finished work
# is kept and not run again.
#
# All arms are trained and evaluated by one code: the queue refuses to start where the code that trains
# (magrpo/, envs/, external/, configs/, train.py) differs from PIN's, the commit of the experiment's first
# run. Run it from its own checkout, so later edits do not reach a run in flight, with KEEP pointing into
# the checkout that commits the records:
#   git worktree add --detach /work/exp_run HEAD && cd /work/exp_run &&
#   KEEP=/work/main/docs/data/reasoning_learning nohup nice -n 10 setsid bash experiments/reasoning_queue.sh ...
set -u
cd "$(dirname "$0")/.."
PY=${MAGRPO_VENV:-$HOME/.cache/magrpo/ci-venv}/bin/python
OUT=${OUT:-experiments/out/reasoning_learning}
KEEP=${KEEP:-docs/data/reasoning_learning}
LIMIT=${LIMIT:-150m}
JOBS=${JOBS:-"method:0 single_agent:0 one_turn:0 method:1 single_agent:1 method:2 single_agent:2 one_turn:1 one_turn:2"}
PIN=${PIN-4c5853e}  # empty: no check (tests)
LOG=$OUT/queue.log
mkdir -p "$OUT" "$KEEP"
say() { echo "$(date -u '+%F %T') $*" >> "$LOG"; }
if [ -n "$PIN" ] && ! git diff --quiet "$PIN" HEAD -- magrpo envs external configs train.py 2>/dev/null; then
    echo "reasoning_queue: this checkout's training code differs from the experiment's commit $PIN (or git cannot" \
         "compare them): run from a checkout whose magrpo/, envs/, external/, configs/ and train.py are $PIN's" >&2
    say "refused: the training code differs from $PIN"
    exit 2
fi

keep() {  # OUT -> KEEP: the report's inputs, never checkpoints
    mkdir -p "$KEEP/untrained"
    cp "$OUT"/untrained/*.json "$KEEP/untrained/" 2>/dev/null
    for dir in "$OUT"/runs/*/seed*; do
        [ -f "$dir/experiment.json" ] || continue  # written only once a run has finished
        local to=$KEEP/runs/${dir#"$OUT"/runs/}
        mkdir -p "$to" && cp "$dir/config.json" "$dir/experiment.json" "$dir/metrics.jsonl" "$to/"
    done
}

# KEEP -> OUT: what an earlier machine finished (no-clobber: OUT's own files win)
[ -d "$KEEP/untrained" ] && mkdir -p "$OUT/untrained" && cp -n "$KEEP"/untrained/*.json "$OUT/untrained/" 2>/dev/null
for dir in "$KEEP"/runs/*/seed*; do
    [ -d "$dir" ] || continue
    to=$OUT/runs/${dir#"$KEEP"/runs/}
    [ -f "$to/experiment.json" ] || { mkdir -p "$to" && cp "$dir"/* "$to/"; }
done

say "queue starts at commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown) on $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
timeout "$LIMIT" "$PY" experiments/reasoning_learning.py untrained --out "$OUT" >> "$OUT/untrained.log" 2>&1
say "untrained: exit $?"
keep
for job in $JOBS; do
    arm=${job%:*} seed=${job#*:}
    say "start $arm $seed"
    timeout "$LIMIT" "$PY" experiments/reasoning_learning.py run --out "$OUT" --arms "$arm" --seeds "$seed" \
        >> "$OUT/run_${arm}_${seed}.log" 2>&1
    say "end $arm $seed: exit $?"
    keep
done
say "queue done"
