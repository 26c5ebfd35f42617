"""Start ``torchrun -m launch.serve`` on loopback for tests, and talk to it with the stdlib."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.distributed import REPO, TORCHRUN_ENV, torchrun_command

SERVING_LINE = re.compile(r"serving .* on http://127\.0\.0\.1:(\d+)")


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    log_path: Path
    base_url: str

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM torchrun and wait for it (it passes the signal on to every rank)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode


def launch_server(nproc: int, *args: str, log_path: Path) -> subprocess.Popen:
    """Start ``torchrun -m launch.serve`` on a free loopback port (``--port 0``); don't wait."""
    env = {**os.environ, **TORCHRUN_ENV}
    cmd = torchrun_command(
        nproc,
        "launch.serve",
        "--host=127.0.0.1",
        "--port=0",
        f"--data-parallel-size={nproc}",
        *args,
    )
    log = open(log_path, "wb")  # noqa: SIM115 - the child writes to it until it exits
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_until_serving(
    proc: subprocess.Popen, log_path: Path, timeout: float = 120
) -> ServerProcess:
    """Wait for the server's "serving ... on http://127.0.0.1:PORT" line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = SERVING_LINE.search(log_path.read_text(errors="replace"))
        if match:
            return ServerProcess(proc, log_path, f"http://127.0.0.1:{match.group(1)}")
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{log_path.read_text()}")
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError(f"server did not start in {timeout} s:\n{log_path.read_text()}")


def start_server(nproc: int, *args: str, log_path: Path, timeout: float = 120) -> ServerProcess:
    """Launch the server and wait until it serves."""
    proc = launch_server(nproc, *args, log_path=log_path)
    return wait_until_serving(proc, log_path, timeout)


def post(base_url: str, path: str, body, *, timeout: float = 120) -> tuple[int, dict]:
    """POST JSON (or raw bytes); (status, decoded JSON body)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        base_url + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(base_url: str, path: str, *, timeout: float = 30) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(base_url + path, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def stream(base_url: str, body: dict, *, timeout: float = 120) -> list:
    """POST with ``stream: true``; the decoded ``data:`` events (the final ``[DONE]`` as a str)."""
    data = json.dumps({**body, "stream": True}).encode()
    request = urllib.request.Request(
        base_url + "/v1/completions", data=data, headers={"Content-Type": "application/json"}
    )
    events = []
    with urllib.request.urlopen(request, timeout=timeout) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        for raw in response:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def run_offline_generate(
    tmp: Path, model_dir: str, prompts: list[list[int]], *flags: str, timeout: float = 180
) -> list[list[int]]:
    """Greedy ``launch.generate`` on 2 ranks (``flags`` as given) over ``prompts``; the output
    token ids of each prompt, in order."""
    prompts_file, out = tmp / "prompts.jsonl", tmp / "out.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    proc = subprocess.run(
        torchrun_command(
            2,
            "launch.generate",
            f"--model={model_dir}",
            f"--prompts={prompts_file}",
            f"--output={out}",
            "--data-parallel-size=2",
            *flags,
        ),
        cwd=REPO,
        env={**os.environ, **TORCHRUN_ENV},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"launch.generate failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line)["output_token_ids"] for line in out.read_text().splitlines()]
