"""Op profiles: where the time of a training step goes, one row per op.

train.py captures the profile (only it touches devices and the run's files) and hands over what
was captured: torch.profiler's key averages (cpu, cuda, native neuron) or the Chrome trace events
of the torch-xla profiler. `table` turns either into the text of runs/<id>/profile.txt and the
top three ops for the ledger. Standard library only.
"""
from collections import Counter, defaultdict

DETAILS_SHOWN = 3  # input shapes (or graphs) listed per op, most time first
DEVICE_TIME = "self device time: the device kernels the op launched (its host time is not counted)"
TIMES = {  # what the time columns measure, by backend (train.Backend.kind)
    "cpu": "self CPU time: inside the op, without the ops it called, on the training thread",
    "cuda": DEVICE_TIME, "neuron": DEVICE_TIME,
    "xla": "device time of each kind of HLO op in the compiled graphs (self: without the ops nested in it). "
           "On XLA the host only traces and launches graphs: the device time per graph is what counts",
}


def torch_ops(averages, device_time: bool) -> dict:
    """key_averages(group_by_input_shape=True) -> {op: [calls, self µs, Counter(input shapes ->
    self µs)]}. Only host-side ops are rows: a device kernel is counted in the op that launched
    it (self_device_time_total), not as a row of its own."""
    ops = defaultdict(lambda: [0, 0.0, Counter()])
    for e in averages:
        if e.device_type.name != "CPU":
            continue
        self_us = e.self_device_time_total if device_time else e.self_cpu_time_total
        shapes = "(" + ", ".join("x".join(map(str, s)) for s in e.input_shapes if s) + ")"
        op = ops[e.key]
        op[0] += e.count
        op[1] += self_us
        op[2][shapes] += self_us
    return {name: op for name, op in ops.items() if op[1] > 0}


def xla_ops(events: list) -> tuple:
    """The torch-xla profiler's trace events -> ({HLO op kind: [calls, self µs, Counter(graph ->
    self µs)]}, {graph: self µs of its ops}). Device ops are the complete events that name an
    `hlo_op`; they nest on their thread (a call or fusion holds the ops inside it), so each one's
    self time leaves out its children. The kind is the opcode (`dot.19` -> `dot`), the graph the
    HLO module."""
    spans = sorted((e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})),
                   key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"]))
    self_us, stack = [], []  # stack: the spans still open on the current thread, as (thread, end, index)
    for i, e in enumerate(spans):
        thread = (e["pid"], e["tid"])
        while stack and (stack[-1][0] != thread or e["ts"] >= stack[-1][1]):
            stack.pop()
        if stack:
            self_us[stack[-1][2]] -= e["dur"]
        self_us.append(e["dur"])
        stack.append((thread, e["ts"] + e["dur"], i))
    ops, graphs = defaultdict(lambda: [0, 0.0, Counter()]), Counter()
    for e, us in zip(spans, self_us):
        op, graph = ops[e["name"].split(".")[0]], e["args"].get("hlo_module", "-")
        op[0] += 1
        op[1] += us
        op[2][graph] += us
        graphs[graph] += us
    return dict(ops), dict(graphs)


def table(header: list, ops: dict, steps: int, step_s: float, times: str, graphs=None) -> tuple:
    """-> (the text of profile.txt, the top three ops as [(op, "31.2%")]). Rows are sorted by
    share = self time / wall time of the profiled steps, so the shares sum to at most 100 % where
    ops do not overlap in time; the rest of the step is spent outside any op."""
    def per_step(us):  # -> (ms per step, share of the step)
        return us / steps / 1e3, us / steps / (step_s * 1e6)

    if not steps:
        raise ValueError("the run stopped before a profiled step finished")
    rows = sorted(ops.items(), key=lambda kv: -kv[1][1])
    lines = header + [f"times: {TIMES[times]}", "share: self time / wall time of the profiled steps",
                      "trace: trace.json next to this file (ui.perfetto.dev or chrome://tracing)"]
    if not rows:
        lines.append("no op events were captured on this backend (on Trainium: README, Op profile)")
    lines += [f"graph {name}: {per_step(us)[0]:.3f} ms/step, {per_step(us)[1]:.1%} of the step"
              for name, us in sorted((graphs or {}).items(), key=lambda kv: -kv[1])]
    lines = [f"# {line}" for line in lines]
    lines.append(f"# {len(rows)} ops, {per_step(sum(op[1] for _, op in rows))[1]:.1%} of the step inside them")
    lines.append(f"{'op':<56} {'calls/step':>10} {'self ms/step':>12} {'share':>7}  "
                 f"{'graphs' if times == 'xla' else 'input shapes'} (most time first)")
    for name, (calls, self_us, details) in rows:
        ms, share = per_step(self_us)
        lines.append(f"{name:<56} {calls / steps:>10.1f} {ms:>12.3f} {share:>7.1%}  "
                     + "; ".join(detail for detail, _ in details.most_common(DETAILS_SHOWN)))
    return "\n".join(lines) + "\n", [(name, f"{per_step(op[1])[1]:.1%}") for name, op in rows[:3]]
