# One image for every process: `orch manager`, `orch service`, `orch migrate`, `orch bench`.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
RUN useradd --create-home --uid 10001 orch

# Dependencies first, pinned by the lock file: this layer is reused until the lock changes.
COPY requirements.lock ./
RUN pip install -r requirements.lock

# Then the code (no dependency resolution here: the lock already installed them).
COPY pyproject.toml README.md ./
COPY contracts contracts
COPY manager manager
COPY observer_service observer_service
COPY migrations migrations
COPY orch orch
COPY orch_bench orch_bench
COPY orch_verify orch_verify
# src/ links each folder under the name it is imported by (contracts/ as orch_contracts, ...).
COPY src src
RUN pip install --no-deps .

USER orch
# The manager's /healthz; a service's compose entry asks its metrics port instead.
HEALTHCHECK --interval=10s --timeout=5s --retries=3 CMD ["orch", "health"]
ENTRYPOINT ["orch"]
