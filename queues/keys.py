"""Every Redis key and channel tailcut uses, built in one place.

Nobody else builds key strings: a renamed key changes here and nowhere else. Each name carries a
comment saying why it exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Tier = Literal["realtime", "normal", "background"]
Bucket = Literal["short", "medium", "long"]

TIERS: tuple[Tier, ...] = ("realtime", "normal", "background")
BUCKETS: tuple[Bucket, ...] = ("short", "medium", "long")

# Consumer group every worker joins on every intake stream; one group means each entry runs once.
WORKER_GROUP = "workers"
# A worker counts as alive for this many of its heartbeat intervals after a beat; then another worker
# takes its entries over.
WORKER_ALIVE_BEATS = 2
# A fencing token outlives any delivery of its entry (a request runs for minutes, not days), and the
# wait of an entry whose first token was drawn with it (a worker trusts that token for seconds only).
FENCE_TTL_S = 86_400
# A drain request no worker took within this long (the worker died first) is forgotten, so a worker
# started later under the same id serves.
DRAIN_REQUEST_TTL_S = 60


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under one prefix (default ``tc:``), so several deployments can share a Redis."""

    prefix: str = "tc:"

    def intake(self, tier: Tier, bucket: Bucket) -> str:
        # One stream per (tier, bucket) so a worker can pick the most urgent, shortest work first.
        return f"{self.prefix}q:{tier}:{bucket}"

    def intake_all(self) -> list[str]:
        """Every intake stream, most urgent first (tier order, then short before long)."""
        return [self.intake(t, b) for t in TIERS for b in BUCKETS]

    def output(self, request_id: str) -> str:
        # Durable, sequence-numbered copy of a request's events: gap fill and Last-Event-ID replay.
        return f"{self.prefix}out:{request_id}"

    def reply_channel(self, api_id: str) -> str:
        # Live pub/sub channel of one API process; subscribed once per process, never per request.
        return f"{self.prefix}reply:{api_id}"

    @property
    def cancel_channel(self) -> str:
        # Broadcast of cancelled request ids; the worker running one aborts it in the engine.
        return f"{self.prefix}cancel"

    def fence(self, request_id: str) -> str:
        # Fencing token of a request: INCR'd at each delivery of its intake entry (a read, a take-over);
        # output writes, acks and requeues carrying an older token are refused, so a slow former owner
        # and the worker that took its entry over never both write.
        return f"{self.prefix}fence:{request_id}"

    def request(self, request_id: str) -> str:
        # An accepted request's record (owner tenant, response shape): what a resume needs, and the
        # check that only its tenant reads it. Kept as long as its output.
        return f"{self.prefix}req:{request_id}"

    def idempotency(self, tenant: str, key: str) -> str:
        # A tenant's Idempotency-Key → the one request it created; a repeat replays that request.
        return f"{self.prefix}idem:{tenant}:{key}"

    def attachments(self, request_id: str) -> str:
        # Counter of clients that attached to a resumable request (a resume adds one): a client that
        # left cancels the request only if nobody attached again within the grace time.
        return f"{self.prefix}attach:{request_id}"

    def cancelled(self, request_id: str) -> str:
        # Tombstone for a cancelled request, so a worker that picks it up later does not run it.
        return f"{self.prefix}cancelled:{request_id}"

    @property
    def workers(self) -> str:
        # Sorted set of live workers, each scored by the time (epoch seconds) until which its last
        # heartbeat vouches for it (``WORKER_ALIVE_BEATS`` of its own beats): readiness.
        return f"{self.prefix}workers"

    def drain(self, worker_id: str) -> str:
        # An operator asked this worker to drain (``POST /admin/workers/{id}/drain``): set by the API,
        # taken by the worker's next heartbeat, which then stops it as SIGTERM would.
        return f"{self.prefix}drain:{worker_id}"

    def api_key(self, key_id: str) -> str:
        # Hash of one API key (``queues.apikeys``): its HMAC (never the key), tenant, tiers, flags.
        return f"{self.prefix}apikey:{key_id}"

    @property
    def api_key_ids(self) -> str:
        # Set of every API key's id: `tailcut keys list`.
        return f"{self.prefix}apikeys"

    def limit_requests(self, tenant: str, minute: int) -> str:
        # Requests a tenant made in one minute (epoch minutes), for its requests-per-minute limit.
        return f"{self.prefix}lim:{tenant}:r:{minute}"

    def limit_tokens(self, tenant: str, minute: int) -> str:
        # Tokens (prompt + max_tokens, settled to the real count) a tenant reserved in one minute.
        return f"{self.prefix}lim:{tenant}:t:{minute}"

    def limit_concurrent(self, tenant: str) -> str:
        # Sorted set of a tenant's requests being answered, scored by the end of their lease.
        return f"{self.prefix}lim:{tenant}:s"

    def limit_queued(self, tenant: str, tier: str) -> str:
        # Sorted set of a tenant's accepted requests of a tier that have not started, scored as above.
        return f"{self.prefix}lim:{tenant}:q:{tier}"

    def worker_info(self, worker_id: str) -> str:
        # Hash describing a live worker (engine, model, pool, load), rewritten by its every beat and
        # expiring with it: the status page's list of workers.
        return f"{self.prefix}worker:{worker_id}"

    @property
    def dead_letter(self) -> str:
        # Requests that will not run (expired, too many deliveries), with the reason.
        return f"{self.prefix}dlq"

    @property
    def events(self) -> str:
        # Operator-facing event log: breaker trips, scale-up signals, degradations.
        return f"{self.prefix}events"

    def breaker(self, tier: Tier) -> str:
        # Hash with the circuit breaker of a tier (state, since when, why), shared by every worker and
        # read by the API for /readyz and its metrics.
        return f"{self.prefix}breaker:{tier}"

    def recent_latencies(self, tier: Tier) -> str:
        # List of a tier's last finished-request latencies (ms, newest first): the consecutive rule.
        return f"{self.prefix}lat:recent:{tier}"

    def latency_window(self, tier: Tier) -> str:
        # Sorted set of a tier's finished-request latencies scored by finish time: the P99 window rule.
        return f"{self.prefix}lat:window:{tier}"

    @property
    def breaker_evaluation(self) -> str:
        # Lock that lets one worker per interval evaluate the window rules for all.
        return f"{self.prefix}breaker:evaluation"

    def answer(self, digest: str, pool: str = "") -> str:
        # A cached reply of a deterministic request (``queues.answers``): model identity, newline, reply.
        # ``pool``: "" the per-tenant answer cache, "tiny" the shared pool of tiny requests.
        return f"{self.prefix}ans:{_pool(pool)}e:{digest}"

    def answer_history(self, digest: str, pool: str = "") -> str:
        # List of the last K reference times (ms) of an answer-cache key, newest first.
        return f"{self.prefix}ans:{_pool(pool)}h:{digest}"

    def answer_index(self, pool: str = "") -> str:
        # Sorted set of the cached answers' keys scored by their K-th most recent reference: eviction order.
        return f"{self.prefix}ans:{_pool(pool)}index"

    @property
    def arq_queue(self) -> str:
        # arq's queue of batch jobs (a sorted set; arq adds ``:health-check``). arq's own per-job keys
        # (``arq:job:*``, ``arq:result:*``) are global: job ids are uuid4, so deployments never collide.
        return f"{self.prefix}arq"

    def job(self, job_id: str) -> str:
        # Hash with a batch job's status and progress counters: written by the API at submit (so GET
        # answers 404 for jobs of other deployments) and by the job runner as chunks finish.
        return f"{self.prefix}job:{job_id}"

    def jobs_runner(self, runner_id: str) -> str:
        # A live jobs process's lease (expires unless renewed): a job whose in-progress mark names a
        # runner without one is run again at once, not after arq's timeout (``queues.jobs.JobLeases``).
        return f"{self.prefix}jobrunner:{runner_id}"

    def job_chunks(self, job_id: str) -> str:
        # Hash of a running job's finished chunk answers by index: a job that arq runs again (its
        # jobs process stopped) skips the chunks already answered.
        return f"{self.prefix}job:{job_id}:chunks"


def _pool(pool: str) -> str:
    return f"{pool}:" if pool else ""
