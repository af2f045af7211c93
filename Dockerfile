# syntax=docker/dockerfile:1
# Build: release binary. Runtime: distroless-like Debian slim, non-root.

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
# Dependencies first, so source edits do not rebuild them. The workspace
# names the bench crate, so its manifest (and a stub) must be there too.
COPY Cargo.toml Cargo.lock ./
COPY bench/Cargo.toml bench/Cargo.toml
RUN mkdir -p src bench/src \
    && echo 'fn main() {}' > src/main.rs && echo '' > src/lib.rs \
    && echo 'fn main() {}' > bench/src/main.rs \
    && cargo build --release --locked -p idpool \
    && rm -rf src
COPY src ./src
COPY migrations ./migrations
# The query macros build from the committed query data, with no database.
COPY .sqlx ./.sqlx
COPY .cargo ./.cargo
RUN touch src/main.rs src/lib.rs && cargo build --release --locked -p idpool --bin idpool

FROM debian:bookworm-slim AS runtime
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin idpool
COPY --from=build /src/target/release/idpool /usr/local/bin/idpool
USER 10001
# Authentication stays on: idpool refuses IDPOOL_AUTH=off on 0.0.0.0.
# Keys: docker run --rm -e DATABASE_URL=... <image> keys create --admin
ENV IDPOOL_LISTEN=0.0.0.0:8080 \
    IDPOOL_AUTH=on \
    RUST_LOG=info
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/idpool"]
CMD ["serve"]
