"""GET /metrics: Prometheus counters and gauges (prometheus-client), named as vLLM names them with a `specdec:` prefix.

Counters appear with prometheus-client's `_total` suffix (`specdec:spec_decode_num_drafts_total`, as vLLM's
`vllm:spec_decode_num_drafts_total`). Speculation counters are vLLM's: drafts verified, draft tokens verified,
accepted draft tokens, and accepted draft tokens per draft position (label `position`, 0 = the first drafted token).
Each app owns its registry, so several servers in one process (tests) keep their counts apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "specdec:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                   80.0)


@dataclass
class Counted:
    """How much of one request's progress the counters already hold (they advance by differences each step)."""

    generated: int = 0
    drafts: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)


class Metrics:
    """The server's Prometheus metrics."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        p = PREFIX
        self.requests = Counter(p + "request_success", "Requests finished, by finish reason (stop, length, abort "
                                "= the client went away, error)", ["finished_reason"], registry=r)
        self.rejected = Counter(p + "request_rejected", "Requests refused before generation, by HTTP status",
                                ["status"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens prefilled", registry=r)
        # prompt caching (engine.Engine's prompt_cache), as vLLM counts its prefix cache: tokens asked, tokens found
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Prompt tokens looked up in the prompt cache",
                                      registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Prompt tokens found in the prompt cache (not prefilled)",
                                   registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests in engine slots", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests in the admission queue", registry=r)
        self.slots = Gauge(p + "num_slots", "Engine slots (--parallel)", registry=r)
        self.drafts = Counter(p + "spec_decode_num_drafts", "Drafts verified", registry=r)
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at "
                                        "each draft position", ["position"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Time from arrival to the last token",
                             buckets=LATENCY_BUCKETS, registry=r)

    def advance(self, counted: Counted, generated: int, stats) -> None:
        """Add what a request did since `counted` (its spec/stats.Stats and tokens generated so far)."""
        self.generation_tokens.inc(generated - counted.generated)
        self.drafts.inc(stats.drafts - counted.drafts)
        self.draft_tokens.inc(stats.drafted - counted.drafted)
        self.accepted_tokens.inc(stats.accepted - counted.accepted)
        for i, a in enumerate(stats.accepted_at):
            before = counted.accepted_at[i] if i < len(counted.accepted_at) else 0
            if a > before:
                self.accepted_per_pos.labels(position=str(i)).inc(a - before)
        counted.generated, counted.drafts, counted.drafted = generated, stats.drafts, stats.drafted
        counted.accepted, counted.accepted_at = stats.accepted, list(stats.accepted_at)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the text exposition format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
