"""Answer bodies: usage, the blockspec stats extension, server-sent events."""

from __future__ import annotations

import asyncio
import json

from fastapi.responses import StreamingResponse

from .worker import Job, Worker

STATS_KEYS = ("mode", "execution", "cached_tokens", "prefill_s", "decode_s", "decode_tokens_per_s", "generated", "cycles",
              "mean_accepted_length", "acceptance_rate", "sampling")


def stats_extension(stats: dict, engine) -> dict:
    out = {k: stats[k] for k in STATS_KEYS if k in stats}
    out.setdefault("mode", engine.mode)
    if "queue_s" in stats:
        out["queue_s"] = stats["queue_s"]
    return out


def usage(prompt_tokens: int, completion_tokens: int, stats: dict) -> dict:
    """OpenAI's usage; prompt_tokens_details.cached_tokens: prompt tokens the kept conversation spared."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.get("cached_tokens", 0)}}


class JobStreamingResponse(StreamingResponse):
    """A streamed answer that stops its job however the stream ends (finished, client gone, server stopping), and
    then the task watching for its client to leave."""

    def __init__(self, content, worker: Worker, job: Job, watcher: asyncio.Future):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.worker, self.job, self.watcher = worker, job, watcher

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.watcher.cancel()
            self.worker.cancel(self.job)


def sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
