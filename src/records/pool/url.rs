//! `REDIS_URL`: one server, a Redis Cluster, or a master behind Sentinel,
//! with or without TLS. SPEC writes a cluster's or Sentinel's nodes as a
//! comma list (`redis-cluster://h1:p1,h2:p2`); fred reads them as `?node=`
//! parameters. Both are accepted; anything else is refused at start with the
//! forms that are.

use fred::prelude::Config;

/// The forms `REDIS_URL` may take.
pub const ACCEPTED: &str = "redis://host:port[/db] or rediss:// (TLS); \
     redis-cluster://h1:p1,h2:p2,... or redis-cluster://h1:p1?node=h2:p2&node=... \
     (rediss-cluster:// for TLS); redis-sentinel://h1:p1,h2:p2/?sentinelServiceName=NAME \
     or redis-sentinel://h1:p1/?sentinelServiceName=NAME&node=h2:p2 (rediss-sentinel:// for TLS)";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("REDIS_URL {url:?}: {why}. Accepted: {ACCEPTED}")]
pub struct UrlError {
    /// The URL with its password masked.
    url: String,
    why: String,
}

const SINGLE: [&str; 2] = ["redis", "rediss"];
const MANY: [&str; 4] = [
    "redis-cluster",
    "rediss-cluster",
    "redis-sentinel",
    "rediss-sentinel",
];

/// The fred configuration of `url`.
pub fn parse(url: &str) -> Result<Config, UrlError> {
    let refuse = |why: String| UrlError {
        url: crate::infra::redact::url_without_password(url),
        why,
    };
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(refuse("no scheme".into()));
    };
    if !SINGLE.contains(&scheme) && !MANY.contains(&scheme) {
        return Err(refuse(format!("unknown scheme {scheme:?}")));
    }
    let rewritten = if MANY.contains(&scheme) {
        node_list_as_parameters(scheme, rest).map_err(refuse)?
    } else if authority(rest).1.contains(',') {
        return Err(refuse(format!(
            "{scheme}:// names one server; a list of nodes needs redis-cluster:// or redis-sentinel://"
        )));
    } else {
        url.to_owned()
    };
    if scheme.ends_with("sentinel") && !rewritten.contains("sentinelServiceName=") {
        return Err(refuse("Sentinel needs ?sentinelServiceName=NAME".into()));
    }
    Config::from_url(&rewritten).map_err(|e| refuse(e.details().to_owned()))
}

/// (userinfo with its `@`, host list, path and query) of what follows `://`.
fn authority(rest: &str) -> (&str, &str, &str) {
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    match authority.rfind('@') {
        Some(at) => (&authority[..=at], &authority[at + 1..], tail),
        None => ("", authority, tail),
    }
}

/// `h1:p1,h2:p2/path?q` → `h1:p1/path?q&node=h2:p2`.
fn node_list_as_parameters(scheme: &str, rest: &str) -> Result<String, String> {
    let (userinfo, hosts, tail) = authority(rest);
    let mut nodes = hosts.split(',').map(str::trim);
    let first = nodes.next().filter(|h| !h.is_empty()).ok_or("no host")?;
    let others: Vec<&str> = nodes.collect();
    for node in std::iter::once(first).chain(others.iter().copied()) {
        let port = node.rsplit_once(':').map(|(_, p)| p);
        if port.is_none_or(|p| p.parse::<u16>().is_err()) {
            return Err(format!("node {node:?} needs host:port"));
        }
    }
    let (path, query) = match tail.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (tail, None),
    };
    let mut parameters: Vec<String> = query
        .into_iter()
        .flat_map(|q| q.split('&'))
        .filter(|p| !p.is_empty())
        .map(str::to_owned)
        .collect();
    parameters.extend(others.iter().map(|node| format!("node={node}")));
    let query = if parameters.is_empty() {
        String::new()
    } else {
        format!("?{}", parameters.join("&"))
    };
    Ok(format!("{scheme}://{userinfo}{first}{path}{query}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use fred::types::config::ServerConfig;

    fn hosts(config: &Config) -> Vec<(String, u16)> {
        match &config.server {
            ServerConfig::Centralized { server } => vec![(server.host.to_string(), server.port)],
            ServerConfig::Clustered { hosts, .. } => {
                hosts.iter().map(|s| (s.host.to_string(), s.port)).collect()
            }
            ServerConfig::Sentinel { hosts, .. } => {
                hosts.iter().map(|s| (s.host.to_string(), s.port)).collect()
            }
        }
    }

    #[test]
    fn both_cluster_forms_name_every_node() {
        let comma = parse("redis-cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002").unwrap();
        let fred = parse("redis-cluster://127.0.0.1:7000?node=127.0.0.1:7001&node=127.0.0.1:7002")
            .unwrap();
        assert!(matches!(comma.server, ServerConfig::Clustered { .. }));
        assert_eq!(hosts(&comma), hosts(&fred));
        assert_eq!(hosts(&comma).len(), 3);
    }

    #[test]
    fn sentinel_forms_keep_the_service_name() {
        for url in [
            "redis-sentinel://127.0.0.1:26379,127.0.0.1:26380/?sentinelServiceName=idpool",
            "redis-sentinel://127.0.0.1:26379/?sentinelServiceName=idpool&node=127.0.0.1:26380",
        ] {
            let config = parse(url).unwrap();
            match &config.server {
                ServerConfig::Sentinel { service_name, .. } => assert_eq!(service_name, "idpool"),
                other => panic!("{url}: {other:?}"),
            }
            assert_eq!(hosts(&config).len(), 2, "{url}");
        }
    }

    #[test]
    fn tls_and_credentials_are_kept() {
        let config = parse("rediss-cluster://app:s3cret@h1:7000,h2:7001").unwrap();
        assert!(config.tls.is_some());
        assert_eq!(config.password.as_deref(), Some("s3cret"));
        assert_eq!(hosts(&config).len(), 2);
        assert!(parse("rediss://h1:6380").unwrap().tls.is_some());
    }

    #[test]
    fn anything_else_is_refused_naming_the_variable_and_the_forms() {
        for (url, says) in [
            ("127.0.0.1:6379", "no scheme"),
            ("http://h:1", "unknown scheme"),
            ("redis://h1:1,h2:2", "names one server"),
            ("redis-cluster://h1,h2:2", "host:port"),
            ("redis-sentinel://h1:1,h2:2", "sentinelServiceName"),
        ] {
            let error = parse(url).unwrap_err().to_string();
            assert!(error.starts_with("REDIS_URL"), "{error}");
            assert!(error.contains(says), "{url}: {error}");
            assert!(error.contains("redis-cluster://h1:p1,h2:p2"), "{error}");
        }
        let error = parse("redis-sentinel://u:topsecret@h1:1")
            .unwrap_err()
            .to_string();
        assert!(!error.contains("topsecret"), "{error}");
    }
}
