"""A real `blockspec serve` subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`blockspec serve --model MODEL --device cpu --dtype float32 --context-length CONTEXT *args`, its output in
    log_path. Start several before waiting for any: they load at the same time."""

    def __init__(self, model, log_path, *args, context_length=1024, api_key=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.api_key = api_key
        key = ["--api-key", api_key] if api_key else []
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # several servers and the tests share two cores
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "blockspec.cli", "serve", "--model", str(model), "--device", "cpu", "--dtype",
             "float32", "--context-length", str(context_length), "--port", str(self.port), *key, *map(str, args)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.output()}")

    def output(self) -> str:
        return open(self.log_path).read()

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0, timeout=60)

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024

    def terminate(self, timeout=30) -> int:
        """SIGTERM, then the exit status (the process is killed if it has not exited within timeout)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        finally:
            self.log.close()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
