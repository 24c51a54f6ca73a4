"""`lazarus simulate` from the command line: the table, config files, one-line errors, plots."""
import json
import struct

import numpy as np
import pytest

from lazarus_cli.main import main

FAST = ["--model", "gpt-s", "--mtbf", "300", "--duration", "1200", "--no-progress"]


def run(capsys, *argv):
    code = main(["simulate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_table_has_every_strategy_ratio_and_category(capsys):
    code, out, _ = run(capsys, *FAST)
    assert code == 0
    for word in ("Lazarus", "DeepSpeed", "DS(FT)", "vs DeepSpeed", "vs DS(FT)", "compute",
                 "reconfiguration", "checkpoint", "restart", "waiting"):
        assert word in out


def test_config_file_and_flags_agree(tmp_path, capsys):
    path = tmp_path / "sim.yaml"
    path.write_text("model: gpt-s\ntrace: {kind: mtbf, mtbf_s: 300, duration_s: 1200}\n")
    _, from_file, _ = run(capsys, "--config", str(path), "--json", "--no-progress")
    _, from_flags, _ = run(capsys, *FAST, "--json")
    assert json.loads(from_file) == json.loads(from_flags)


def test_spot_trace_by_name(capsys):
    code, out, _ = run(capsys, "--trace", "aws-p2", "--scale-to", "10", "--model", "gpt-s",
                       "--no-progress")
    assert code == 0 and "Bamboo" in out


@pytest.mark.parametrize("content,field", [
    ("model: gpt-xl\n", "model.preset"),
    ("cluster: {nodes: 0}\n", "cluster.nodes"),
    ("cluster: {policy: random}\n", "cluster.policy"),
    ("trace: {kind: mtbf, mtbf: 300}\n", "trace.mtbf"),
    ("trace: {kind: mtbf, mtbf_s: fast}\n", "trace.mtbf_s"),
    ("costs: {rebuild_s: -1}\n", "costs.rebuild_s"),
    ("strategies: {lazarus: {checkpoint_every: 0}}\n", "strategies.lazarus.checkpoint_every"),
    ("strategies: {megatron: {}}\n", "strategies.megatron"),
    ("seeds: 0\n", "seeds"),
    # NaN passed every range check and ran to an assertion; a tiny MTBF drew losses until
    # memory ran out.
    ("trace: {kind: mtbf, mtbf_s: .nan}\n", "trace.mtbf_s: must be a finite number"),
    ("trace: {kind: mtbf, duration_s: .inf}\n", "trace.duration_s: must be a finite number"),
    ("trace: {kind: mtbf, mtbf_s: 1.0e-9, duration_s: 100}\n",
     "trace.mtbf_s: duration_s / mtbf_s = 100,000,000,000 expected losses, at most 100,000"),
    ("trace: {kind: zones, node_mtbf_s: 0.001}\n", "trace.node_mtbf_s"),
    ("trace: {kind: availability, scale_to: 100000}\n", "trace.scale_to: at most 4,096"),
    ("seeds: 1000000\n", "seeds: must be an integer from 1 to 1,000"),
    ("seeds: 1000\ntrace: {kind: mtbf, mtbf_s: 1, duration_s: 1000}\n",
     "seeds: 1,000 traces x 1,000 expected losses each, at most 100,000"),
    ("cluster: {min_replicas: 65}\n", "cluster.min_replicas: must be 1-64"),
    ("cluster: {gpus_per_node: 64, slots_per_gpu: 17}\n",
     "cluster.gpus_per_node x slots_per_gpu: at most 1,024"),
    ("model: {preset: gpt-s, experts: 5000}\n", "model.experts: at most 1,024"),
    ("model: gpt-s\nloads: [.inf, 1, 1, 1, 1, 1, 1, 1]\n", "loads: give 8 finite non-negative"),
    ("model: gpt-s\nloads: [true, 1, 1, 1, 1, 1, 1, 1]\n", "loads: give 8 finite non-negative"),
    ("[1, 2\n", "--config"),
    # A mean gap of 0 or less is refused alike, under the field's own name.
    ("trace: {kind: mtbf, mtbf_s: -5}\n", "trace.mtbf_s: must be > 0, got -5.0"),
    ("trace: {kind: zones, node_mtbf_s: 0}\n", "trace.node_mtbf_s: must be > 0"),
    ("trace: {kind: zones, zones: 0}\n", "trace.zones: must be >= 1"),
    # Nodes that could never hold the model: every strategy waited the whole trace.
    ("cluster: {nodes: 2, slots_per_gpu: 7}\n",
     "cluster.nodes: GPT-L's 16 experts need as many expert slots, and 2 nodes of 7 hold 14"),
    ("trace: {kind: zones, zones: 1, nodes_per_zone: 2}\n",
     "trace.zones x trace.nodes_per_zone: GPT-L's 16 experts"),
    ("trace: {kind: availability, scale_to: 2}\n", "trace.scale_to: GPT-L's 16 experts"),
])
def test_bad_config_is_one_line_naming_the_field(tmp_path, capsys, content, field):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    code, out, err = run(capsys, "--config", str(path), "--no-progress")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"lazarus: error: {field}")


def png_pixels(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 300 and height >= 200
    image = pytest.importorskip("matplotlib.image")
    return image.imread(str(path))


def test_plots_are_non_empty_images(tmp_path, capsys):
    code, _, err = run(capsys, *FAST, "--out", str(tmp_path))
    assert code == 0
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == ["recovery.png", "samples_over_time.png", "throughput_vs_skew.png",
                     "time_breakdown.png"]
    for name in names:
        pixels = png_pixels(tmp_path / name)
        colours = np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)
        assert len(colours) > 10, f"{name} is (nearly) a single colour"
        assert f"wrote {tmp_path / name}" in err
