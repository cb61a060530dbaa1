"""Manifests: one file per process, read back, scheduler count and fingerprint checked."""

from true_on_policy.manifest import Manifest, PatchRecord, check_schedulers, read_all


def test_write_read_and_check(tmp_path):
    Manifest(role="launcher", contract="c_v1", fingerprint="f").write(tmp_path)
    for tp in range(2):
        m = Manifest(role="scheduler", contract="c_v1", fingerprint="f", pid=100 + tp,
                     ranks={"tp": tp, "pp": 0, "ep": 0}, patches=[PatchRecord("p", ["a.b: x -> y"])])
        assert m.write(tmp_path).name == f"scheduler-tp{tp}-pp0-ep0-{100 + tp}.json"
    got = read_all(tmp_path)
    assert sorted(m["role"] for m in got) == ["launcher", "scheduler", "scheduler"]
    assert got[1]["patches"][0]["replacements"] == ["a.b: x -> y"]
    assert check_schedulers(got, 2, "f") == []
    assert "2 scheduler manifest(s) found, 4 expected" in check_schedulers(got, 4, "f")[0]
    assert any("fingerprint" in p for p in check_schedulers(got, 2, "g"))


def test_captured_graphs_reads_each_scheduler_manifests_capture_record():
    from true_on_policy import manifest

    rec = {"decode_batch_sizes": [1, 2], "decode_tiles": [], "decode_tiles_s": 1.5}
    ms = [{"role": "scheduler", "extra": {"cuda_graph": rec}}, {"role": "tokenizer", "extra": {"cuda_graph": {}}},
          {"role": "scheduler", "extra": None}, {"role": "scheduler"}]
    assert manifest.captured_graphs(ms) == [rec, {}, {}]
