"""The loggers a translated verl run names (trainer.logger=['console','wandb'], tensorboard, mlflow), for real:
train_dapo.Logger writes our metrics and each backend's own reader gets them back. Needs the test extras
(pip install wandb tensorboard mlflow); a missing one fails, it is not skipped."""
import glob
import json
import os
import struct
import time

import train_dapo as T

METRICS = {1: {"train/acc": 0.25, "val/acc@4": 0.5}, 2: {"train/acc": 0.75}}


def log_run(tmp_path, logger):
    cfg = T.Config(out_dir=str(tmp_path / "out"), logger=logger, project_name="verl_proj",
                   experiment_name="exp1")
    os.makedirs(cfg.out_dir)
    log = T.Logger(cfg, 0)
    for step, metrics in METRICS.items():
        log.log(step, metrics)
    return log


def test_tensorboard_event_file_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    log = log_run(tmp_path, ["console", "tensorboard"])
    log.close()  # the writer flushes on close (else every 2 minutes)
    acc = EventAccumulator(str(tmp_path / "out" / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/acc")] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("val/acc@4")] == [(1, 0.5)]


def test_wandb_offline_run_holds_our_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = log_run(tmp_path, ["console", "wandb"])
    run = log.backends["wandb"].run
    assert (run.project, run.name, run.config["experiment_name"]) == ("verl_proj", "exp1", "exp1")
    log.close()  # finishes the wandb run
    [path] = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = finished_records(path)
    assert [(r.run.project, r.run.display_name) for r in records if r.HasField("run")] == [("verl_proj", "exp1")]
    history = [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.HasField("history")]
    assert [{k: h[k] for k in h if not k.startswith("_")} | {"_step": h["_step"]} for h in history] == [
        {"train/acc": 0.25, "val/acc@4": 0.5, "_step": 1}, {"train/acc": 0.75, "_step": 2}]


def finished_records(path, timeout_s: float = 60.0):
    """The run's records once its exit record is on disk: wandb's service process writes the file, and on a
    loaded machine it can still be writing when finish() has returned (once, a full test run read no record)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = wandb_records(path)
        if any(r.HasField("exit") for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def wandb_records(path):
    """An offline run's .wandb file: a 7-byte header, then LevelDB-log records (crc32, length, type) of
    wandb's protobuf Records in 32 KiB blocks. A record that crosses a block's end comes in fragments (type
    FIRST, MIDDLE..., LAST), joined here before parsing: where it falls depends on what came before it."""
    from wandb.proto import wandb_internal_pb2
    full, first, middle, last = 1, 2, 3, 4
    data, pos, out, parts = open(path, "rb").read(), 7, [], []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + n > len(data):  # the writer is still at it
            break
        assert kind in (full, first, middle, last), f"record type {kind} at byte {pos}"
        parts.append(data[pos + 7:pos + 7 + n])
        pos += 7 + n
        if kind in (full, last):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            out.append(record)
            parts = []
    return out


def test_mlflow_file_store_holds_the_run(tmp_path, monkeypatch):
    import mlflow
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 keeps the file store behind this switch
    log = log_run(tmp_path, ["console", "mlflow"])
    run_id = mlflow.active_run().info.run_id
    log.close()  # ends the mlflow run
    assert mlflow.active_run() is None
    client = mlflow.tracking.MlflowClient()
    run = client.get_run(run_id)
    assert run.info.run_name == "exp1"
    assert client.get_experiment(run.info.experiment_id).name == "verl_proj"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/acc")] == [(1, 0.25), (2, 0.75)]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "val/acc_at_4")] == [(1, 0.5)]
    assert log.backends["mlflow"] is mlflow
