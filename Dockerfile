FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY contracts contracts
COPY manager manager
COPY observer_service observer_service
COPY migrations migrations
COPY orch orch
RUN pip install --no-cache-dir .
# One process per container; `orch service` stops gracefully on SIGTERM (scale-down).
ENTRYPOINT ["orch"]
