"""lab/blktests.py: reading ./check's console and comparing the two targets."""
from nvmeof_roce.lab import blktests as B

KERNEL_LOG = """\
./check: gawk is not available. Install GNU awk.
nvme/002 (tr=rdma) (create many subsystems and test discovery) [not run]
    runtime    ...  12.960s
    nvme_trtype=rdma is not supported in this test
nvme/010 (tr=rdma bd=device) (run data verification fio job)
nvme/010 (tr=rdma bd=device) (run data verification fio job) [passed]
    runtime    ...  189.982s
nvme/010 (tr=rdma bd=file) (run data verification fio job)   [passed]
    runtime    ...  180.1s
nvme/029 (tr=rdma) (test userspace IO via nvme-cli read/write interface) [passed]
    runtime  2.1s  ...  2.3s
nvme/030 (tr=rdma) (ensure the discovery generation counter is updated appropriately) [passed]
nvme/031 (tr=rdma) (test deletion of NVMeOF controllers immediately after setup) [passed]
"""
OURS_LOG = """\
nvme/002 (tr=rdma) (create many subsystems and test discovery) [not run]
    nvme_trtype=rdma is not supported in this test
nvme/010 (tr=rdma bd=file) (run data verification fio job)   [passed]
nvme/029 (tr=rdma) (test userspace IO via nvme-cli read/write interface) [failed]
    runtime  2.1s  ...  2.3s
    --- tests/nvme/029.out
nvme/030 (tr=rdma) (ensure the discovery generation counter is updated appropriately) [not run]
    Linux kernel soft target not available
nvme/031 (tr=rdma) (test deletion of NVMeOF controllers immediately after setup) [passed]
"""


def test_parse_keeps_conditions_but_the_transport_and_the_skip_reasons():
    kernel = B.parse_check_log(KERNEL_LOG)
    assert list(kernel) == ["nvme/002", "nvme/010 (bd=device)", "nvme/010 (bd=file)", "nvme/029", "nvme/030",
                            "nvme/031"]
    assert kernel["nvme/002"].status == "not run"
    assert kernel["nvme/002"].reasons == ["nvme_trtype=rdma is not supported in this test"]
    assert kernel["nvme/010 (bd=device)"].status == "passed" and kernel["nvme/010 (bd=device)"].reasons == []
    # each run's time is this run's, not the previous one's (`runtime  LAST  ...  THIS`)
    assert kernel["nvme/010 (bd=device)"].seconds == 189.982 and kernel["nvme/029"].seconds == 2.3
    assert kernel["nvme/030"].seconds is None


def test_compare_explains_each_difference_and_flags_the_unexplained():
    rows = {r["test"]: r for r in B.compare(B.parse_check_log(KERNEL_LOG), B.parse_check_log(OURS_LOG))}
    assert rows["nvme/002"]["why"] == "" and rows["nvme/031"]["why"] == ""
    assert rows["nvme/029"]["why"].startswith("DEFECT")
    assert rows["nvme/030"]["why"].startswith("not applicable") and "_require_kernel_nvme_target" in \
        rows["nvme/030"]["why"]
    assert rows["nvme/010 (bd=device)"]["ours"] == "-" and "bd=file variant only" in rows["nvme/010 (bd=device)"]["why"]
    assert rows["nvme/010 (bd=file)"]["why"] == ""
    md = B.table_markdown(list(rows.values()), "6.1.0-99-amd64", {"kernel": 700, "ours": 650})
    assert "nvmet passed 5, ours 2, both 2" in md and "| nvme/029 | passed | failed | 2 | 2 | DEFECT" in md
    assert "| nvme/010 (bd=file) | passed | passed | 180 | - |  |" in md


def test_write_table_from_the_logs_of_a_run(tmp_path):
    # --table-only: the table again from a run's directory; a missing log compares as absent
    (tmp_path / "kernel.release").write_text("6.12.1-amd64\n")
    (tmp_path / "kernel.log").write_text(KERNEL_LOG)
    (tmp_path / "kernel.seconds").write_text("700\n")
    assert B.write_table(tmp_path, ["kernel"]) == 0  # one mode: nothing to compare
    md = (tmp_path / "table.md").read_text()
    assert "kernel 6.12.1-amd64: nvmet passed 5, ours 0" in md and "700 s (nvmet) and ? s (ours)" in md
    assert B.write_table(tmp_path, ["kernel", "ours"]) == 1  # ours never ran: not a pass
    (tmp_path / "ours.log").write_text(OURS_LOG)
    assert B.write_table(tmp_path, ["kernel", "ours"]) == 1  # nvme/029 passed on nvmet only
    import json
    rows = {r["test"]: r for r in json.loads((tmp_path / "table.json").read_text())["rows"]}
    assert rows["nvme/029"]["kernel_seconds"] == 2.3 and rows["nvme/029"]["ours"] == "failed"
