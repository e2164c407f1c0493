"""fio-jobs/ and the fio wrapper, run for real with fio against a plain file."""
import os
import re
import shutil
from pathlib import Path

import pytest

from nvmeof_roce.bench import fio as fiomod
from nvmeof_roce.bench.fio import FioJobFile, list_job_files, parse_fio_json, run_fio
from nvmeof_roce.errors import NvmeofError, ToolMissing

FIXTURES = Path(__file__).parent / "fixtures" / "bench"
JOBS = list_job_files()

needs_fio = pytest.mark.skipif(shutil.which("fio") is None,
                               reason="fio is not installed (apt-get install fio) - the job files run for real")


def _o_direct_ok(directory: Path) -> bool:
    probe = directory / ".odirect"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return True


@pytest.fixture
def data_file(tmp_path):
    if not _o_direct_ok(tmp_path):
        pytest.skip(f"{tmp_path} does not support O_DIRECT (tmpfs?): the job files use direct=1")
    return tmp_path / "x.img"


# --- the job files as text ---------------------------------------------------------------------------

def test_the_expected_jobs_exist():
    assert set(JOBS) >= {"randread-4k-qd1", "randread-4k-qd32", "randwrite-4k-qd32", "seqread-128k-qd16",
                         "seqwrite-128k-qd16", "randrw-4k-70-30-qd16", "verify-crc32c-64k-qd8"}


def _options(path: Path) -> dict:
    opts = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith((";", "#", "[")):
            continue
        key, _, value = line.partition("=")
        opts[key.strip()] = value.strip()
    return opts


@pytest.mark.parametrize("name", sorted(JOBS))
def test_job_file_parameters(name):
    job = JOBS[name]
    opts = _options(job.path)
    assert opts["filename"] == "${DEVICE}"
    assert opts["runtime"] == "${RUNTIME}"
    assert opts["size"] == "${SIZE}"
    assert opts["ramp_time"] == "${RAMP}"
    assert opts["percentile_list"] == "50:90:99:99.9"
    assert opts["direct"] == "1" and opts["ioengine"] == "libaio" and opts["time_based"] == "1"
    assert job.description and job.report in ("read", "write", "mixed")
    # the name says what the file does
    m = re.match(r"^(randread|randwrite|seqread|seqwrite|randrw|verify)-.*?(\d+)k.*-qd(\d+)$", name)
    assert m, name
    assert opts["bs"] == f"{m.group(2)}k"
    assert opts["iodepth"] == m.group(3)
    expected_rw = {"randread": "randread", "randwrite": "randwrite", "seqread": "read", "seqwrite": "write",
                   "randrw": "randrw", "verify": "randwrite"}[m.group(1)]
    assert opts["rw"] == expected_rw


def test_verify_and_mixed_job_options():
    v = _options(JOBS["verify-crc32c-64k-qd8"].path)
    assert v["verify"] == "crc32c" and v["do_verify"] == "1" and v["verify_fatal"] == "1"
    assert int(v["verify_backlog"]) > 0  # time_based would never reach a final verify phase
    m = _options(JOBS["randrw-4k-70-30-qd16"].path)
    assert m["rwmixread"] == "70" and m["unified_rw_reporting"] == "both"


def test_job_metadata_is_read_from_the_leading_comments(tmp_path):
    p = tmp_path / "j.fio"
    p.write_text("; description: a test job\n; report: write\n\n[global]\n; report: read\n[j]\nrw=write\n")
    job = FioJobFile.load(p)
    assert (job.name, job.description, job.report) == ("j", "a test job", "write")
    p.write_text("; report: sideways\n[j]\n")
    with pytest.raises(NvmeofError, match="sideways"):
        FioJobFile.load(p)


# --- every job file, for real -------------------------------------------------------------------------

@needs_fio
@pytest.mark.parametrize("name", sorted(JOBS))
def test_job_file_runs_on_a_plain_file(name, data_file, tmp_path):
    job = JOBS[name]
    out = tmp_path / "out.json"
    res = run_fio(job, str(data_file), runtime=1, size="16M", ramp=0, output_path=out)
    assert out.exists() and "jobs" in out.read_text()
    assert res.job == name
    assert res.errors == 0, res.error_text
    assert res.iops > 0 and res.bw_bytes > 0
    lat = res.clat_us
    assert all(lat[k] is not None and lat[k] > 0 for k in ("p50", "p90", "p99", "p99.9"))
    assert lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p99.9"]
    bs = int(re.search(r"-(\d+)k-", name).group(1)) * 1024
    # bandwidth and IOPS agree through the block size (fio rounds both)
    assert res.bw_bytes == pytest.approx(res.iops * bs, rel=0.02)
    assert res.runtime_ms > 0 and res.fio_version.startswith("fio-")
    if job.report == "read":
        assert res.directions["read"].total_ios > 0 and res.directions["write"].total_ios == 0
    if name.startswith(("randwrite", "seqwrite")):
        assert res.directions["read"].total_ios == 0


@needs_fio
def test_mixed_job_reports_read_write_and_combined(data_file):
    res = run_fio(JOBS["randrw-4k-70-30-qd16"], str(data_file), runtime=1, size="16M")
    d = res.directions
    assert res.report == "mixed"
    assert d["mixed"].total_ios == d["read"].total_ios + d["write"].total_ios
    share = d["read"].total_ios / d["mixed"].total_ios
    assert 0.6 < share < 0.8
    assert res.iops == d["mixed"].iops


@needs_fio
def test_verify_job_reads_back_what_it_wrote(data_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = run_fio(JOBS["verify-crc32c-64k-qd8"], str(data_file), runtime=1, size="16M", ramp=0,
                  output_path=tmp_path / "out" / "v.json")
    assert not list(tmp_path.rglob("*.state"))  # no verify state files left behind
    assert res.errors == 0
    assert res.report == "write"
    assert res.directions["write"].total_ios > 0
    # verify_backlog: the written blocks were read back during the run
    assert res.directions["read"].total_ios > 0


@needs_fio
def test_ramp_time_is_passed_to_fio(data_file, tmp_path):
    out = tmp_path / "o.json"
    run_fio(JOBS["randread-4k-qd1"], str(data_file), runtime=1, size="8M", ramp=1, output_path=out)
    doc = fiomod._json_document(out.read_text())
    assert doc["global options"]["ramp_time"] == "1"
    assert doc["global options"]["runtime"] == "1"
    assert doc["global options"]["size"] == "8M"
    assert doc["global options"]["filename"] == str(data_file)


@needs_fio
def test_verification_failure_is_reported_not_raised(tmp_path):
    """A region of zeros read with crc32c verification: fio fails the job with EILSEQ."""
    if not _o_direct_ok(tmp_path):
        pytest.skip("no O_DIRECT here")
    img = tmp_path / "zeros.img"
    img.write_bytes(bytes(4 << 20))
    job = tmp_path / "check.fio"
    job.write_text("; report: read\n[check]\nfilename=${DEVICE}\nsize=${SIZE}\nruntime=${RUNTIME}\n"
                   "ramp_time=${RAMP}\nrw=read\nbs=4k\nioengine=libaio\ndirect=1\n"
                   "verify=crc32c\nverify_only=1\nverify_fatal=1\n")
    res = run_fio(job, str(img), runtime=5, size="4M")
    assert res.errors >= 1
    assert "verification failed" in res.error_text
    assert "bad magic header" in res.error_text  # fio's own words, from its stderr


@needs_fio
def test_fio_that_cannot_open_the_device_raises(tmp_path):
    not_a_dir = tmp_path / "plain-file"
    not_a_dir.write_text("")
    with pytest.raises(NvmeofError, match="fio randread-4k-qd1 on .* failed"):
        run_fio(JOBS["randread-4k-qd1"], str(not_a_dir / "dev"), runtime=1, size="1M")


def test_missing_fio_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ToolMissing) as exc:
        run_fio(JOBS["randread-4k-qd1"], "/dev/null", runtime=1, size="1M")
    assert "apt-get install fio" in str(exc.value)


# --- the parser on captured output --------------------------------------------------------------------

def _fixture(name):
    p = FIXTURES / name
    if not p.exists():
        pytest.skip(f"fixture {p} not captured yet")
    return p.read_text()


def test_parser_skips_notes_before_the_json():
    text = _fixture("fio-host-notes-before-json.json")
    assert not text.lstrip().startswith("{")  # the capture really has fio's note first
    res = parse_fio_json(text)
    assert res.iops > 0 and res.errors == 0


def test_parser_rejects_non_json():
    with pytest.raises(NvmeofError, match="not fio JSON"):
        parse_fio_json("fio: some failure\n")
    with pytest.raises(NvmeofError, match="no jobs"):
        parse_fio_json('{"jobs": []}')


@pytest.mark.parametrize("name", ["fio-nvmeof-randread-4k-qd32.json", "fio-nvmeof-randrw-4k-70-30-qd16.json",
                                  "fio-nvmeof-verify-crc32c-64k-qd8.json", "fio-nvmeof-randread-4k-qd1.json"])
def test_parser_on_real_nvmeof_output(name):
    """fio JSON captured in the lab, from an NVMe-oF namespace (kernel host -> nvmet-rdma over rxe0)."""
    import json
    text = _fixture(name)
    doc = json.loads(text[text.index("{"):])
    j = doc["jobs"][0]
    assert j["job options"].get("filename", doc["global options"].get("filename", "")).startswith("/dev/nvme")
    res = parse_fio_json(text)
    head = "mixed" if "mixed" in j else ("write" if j["write"]["total_ios"] and not j["read"]["total_ios"]
                                         else "read")
    if name.startswith("fio-nvmeof-verify"):
        res = parse_fio_json(text, report="write")
        head = "write"
    assert res.iops == pytest.approx(j[head]["iops"])
    assert res.bw_bytes == pytest.approx(j[head]["bw_bytes"])
    assert res.clat_us["p99"] == pytest.approx(j[head]["clat_ns"]["percentile"]["99.000000"] / 1000)
    assert res.clat_us["p99.9"] == pytest.approx(j[head]["clat_ns"]["percentile"]["99.900000"] / 1000)
    assert res.errors == 0
