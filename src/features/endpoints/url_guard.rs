//! Endpoint URLs come from tenants: without a guard, a tenant could make
//! the instance post to its own loopback services, the cloud metadata
//! address or the private network behind it (server-side request
//! forgery). A URL is checked when it is saved, and the address actually
//! connected to is checked again at every connection: the resolver the
//! delivery client uses refuses a name that resolves (now, not when it was
//! saved) to an address of the kinds below.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

/// Longest endpoint URL accepted.
pub const MAX_URL_LEN: usize = 2048;

/// How long resolving a name may take when a URL is saved (waiting for a
/// turn included).
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(3);

/// Names resolved at once for URLs being saved: each resolution takes a
/// thread of the blocking pool (the system resolver) that a timeout
/// cannot take back, so a flood of saves with slow names must not take
/// the threads other work needs.
const RESOLVING_AT_ONCE: usize = 8;
static RESOLVING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(RESOLVING_AT_ONCE);

/// Why a URL was refused; the text is what the tenant reads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// Whether private addresses are allowed (`IDPOOL_ENDPOINTS_ALLOW_PRIVATE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UrlPolicy {
    pub allow_private: bool,
}

/// Whether an address may be posted to: a public unicast address. Refused:
/// loopback, unspecified, private (RFC 1918), shared (CGNAT), link-local
/// (cloud metadata at 169.254.169.254), unique-local, multicast,
/// broadcast, documentation, benchmarking and reserved ranges, Azure's
/// platform address, and IPv6 forms that carry one of those IPv4
/// addresses (mapped, compatible, NAT64, 6to4).
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => is_public_v6(v6),
    }
}

/// Azure's virtual public address: public in form, but from inside a VM
/// it answers as the platform (its agent, DNS, health, metadata).
const AZURE_PLATFORM: Ipv4Addr = Ipv4Addr::new(168, 63, 129, 16);

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    let refused = ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_multicast()
        || ip.is_broadcast()
        || ip.is_documentation()
        || a == 0 // "this network"
        || (a == 100 && (64..128).contains(&b)) // shared address space (CGNAT)
        || (a == 192 && b == 0 && c == 0) // IETF protocol assignments
        || (a == 198 && (b == 18 || b == 19)) // benchmarking
        || (a == 192 && b == 88 && c == 99) // 6to4 relay anycast (deprecated)
        || ip == AZURE_PLATFORM
        || a >= 240; // reserved
    !refused
}

fn is_public_v6(ip: Ipv6Addr) -> bool {
    if let Some(v4) = embedded_v4(ip) {
        return is_public_v4(v4);
    }
    let [first, second, ..] = ip.segments();
    let refused = ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_multicast()
        || (first & 0xfe00) == 0xfc00 // unique local fc00::/7
        || (first & 0xffc0) == 0xfe80 // link-local fe80::/10
        || (first & 0xffc0) == 0xfec0 // site-local (deprecated) fec0::/10
        || (first == 0x2001 && second == 0x0db8) // documentation
        || (first == 0x2001 && second == 0) // Teredo: an IPv4 address inside, obfuscated
        || (first == 0x2001 && second == 0x0002) // benchmarking 2001:2::/48
        || (first == 0x2001 && (second & 0xfff0) == 0x0010) // ORCHID 2001:10::/28
        || (first == 0x2001 && (second & 0xfff0) == 0x0020) // ORCHIDv2 2001:20::/28
        || (first & 0xfff0) == 0x3ff0 // documentation 3fff::/20
        || first == 0x5f00 // segment routing 5f00::/16
        || first == 0x0100 // discard-only 100::/64
        || (first == 0x0064 && second == 0xff9b && ip.segments()[2] != 0) // local-use NAT64 64:ff9b:1::/48
        || (first & 0xe000) != 0x2000; // outside global unicast 2000::/3
    !refused
}

/// The IPv4 address an IPv6 address stands for, where it does: mapped
/// (`::ffff:a.b.c.d`), compatible (`::a.b.c.d`), NAT64 (`64:ff9b::/96`)
/// and 6to4 (`2002:AABB:CCDD::/48`).
fn embedded_v4(ip: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = ip.segments();
    let low = || Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    if let Some(v4) = ip.to_ipv4_mapped() {
        return Some(v4);
    }
    // IPv4-translated (SIIT) ::ffff:0:a.b.c.d
    if s[..6] == [0, 0, 0, 0, 0xffff, 0] {
        return Some(low());
    }
    if s[..6] == [0, 0, 0, 0, 0, 0] && !ip.is_loopback() && !ip.is_unspecified() {
        return Some(low());
    }
    if s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0, 0, 0, 0] {
        return Some(low());
    }
    if s[0] == 0x2002 {
        return Some(Ipv4Addr::new(
            (s[1] >> 8) as u8,
            s[1] as u8,
            (s[2] >> 8) as u8,
            s[2] as u8,
        ));
    }
    None
}

/// Parses and checks a URL as given: `http` or `https`, a host, no
/// fragment, at most [`MAX_URL_LEN`] bytes, and (unless private addresses
/// are allowed) no IP address that is not public. Names are checked by
/// [`check_resolved`]. Hosts are normalised as browsers do, so
/// `http://0x7f.1/` is `127.0.0.1` and refused.
pub fn parse(raw: &str, policy: UrlPolicy) -> Result<url::Url, Refused> {
    if raw.len() > MAX_URL_LEN {
        return Err(Refused(format!(
            "the URL is longer than {MAX_URL_LEN} bytes"
        )));
    }
    let url = url::Url::parse(raw).map_err(|e| Refused(format!("the URL is not usable: {e}")))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(Refused("the URL must be http:// or https://".into()));
    }
    if url.fragment().is_some() {
        return Err(Refused(
            "the URL has a fragment (#), which is never sent".into(),
        ));
    }
    // `https:///in` parses with the host `in`: not what anyone wrote.
    let authority = raw.split_once("://").map_or("", |(_, rest)| rest);
    let Some(host) = url.host().filter(|_| !authority.starts_with('/')) else {
        return Err(Refused("the URL names no host".into()));
    };
    if url.port() == Some(0) {
        return Err(Refused("the URL names port 0".into()));
    }
    if !policy.allow_private {
        let literal = match host {
            url::Host::Ipv4(v4) => Some(IpAddr::V4(v4)),
            url::Host::Ipv6(v6) => Some(IpAddr::V6(v6)),
            url::Host::Domain(_) => None,
        };
        if let Some(ip) = literal.filter(|ip| !is_public(*ip)) {
            return Err(refused_address(ip));
        }
    }
    Ok(url)
}

fn refused_address(ip: IpAddr) -> Refused {
    Refused(format!(
        "the URL leads to {ip}, a loopback, private, link-local or otherwise non-public address; \
         endpoints must be reachable on the public internet"
    ))
}

/// Resolves the URL's name (when it is one) and refuses it unless every
/// address is public: what a saved URL must pass.
pub async fn check_resolved(url: &url::Url, policy: UrlPolicy) -> Result<(), Refused> {
    if policy.allow_private {
        return Ok(());
    }
    let Some(url::Host::Domain(name)) = url.host() else {
        return Ok(());
    };
    let port = url.port_or_known_default().unwrap_or(443);
    let resolved = tokio::time::timeout(RESOLVE_TIMEOUT, async {
        let _turn = RESOLVING.acquire().await;
        tokio::net::lookup_host((name.to_owned(), port)).await
    })
    .await;
    let addresses = resolved
        .map_err(|_| Refused(format!("the host {name} did not resolve in time")))?
        .map_err(|_| Refused(format!("the host {name} cannot be resolved")))?;
    let mut any = false;
    for address in addresses {
        any = true;
        if !is_public(address.ip()) {
            return Err(refused_address(address.ip()));
        }
    }
    if !any {
        return Err(Refused(format!("the host {name} has no address")));
    }
    Ok(())
}

/// The delivery client's resolver: the system's, with every address
/// checked. A name whose addresses include one that is not public fails
/// to resolve, so no connection is made to it, whatever it resolved to
/// when it was saved.
pub struct GuardedResolver;

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let found: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            if let Some(bad) = found.iter().find(|a| !is_public(a.ip())) {
                return Err(
                    Box::new(NotPublic(bad.ip())) as Box<dyn std::error::Error + Send + Sync>
                );
            }
            Ok(Box::new(found.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// A name resolved to an address deliveries may not go to.
#[derive(Debug, thiserror::Error)]
#[error("refused address {0} (not public)")]
pub struct NotPublic(pub IpAddr);

/// The client endpoint deliveries go through: no redirects, no proxy
/// from the environment (it would connect elsewhere than checked), and,
/// unless private addresses are allowed, the guarded resolver.
pub fn client(
    policy: UrlPolicy,
    timeout: Duration,
    idle_per_host: usize,
) -> reqwest::Result<reqwest::Client> {
    let builder = reqwest::Client::builder()
        .timeout(timeout)
        .connect_timeout(timeout.min(Duration::from_secs(10)))
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .pool_max_idle_per_host(idle_per_host);
    let builder = match policy.allow_private {
        true => builder,
        false => builder.dns_resolver(Arc::new(GuardedResolver)),
    };
    builder.build()
}

#[cfg(test)]
mod tests {
    use super::*;

    const STRICT: UrlPolicy = UrlPolicy {
        allow_private: false,
    };

    #[test]
    fn addresses_that_lead_inside_are_refused() {
        for inside in [
            "127.0.0.1",
            "127.8.9.10",
            "0.0.0.0",
            "10.1.2.3",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "224.0.0.1",
            "255.255.255.255",
            "::1",
            "::",
            "fe80::1",
            "fd00::1",
            "fc00::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "::127.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "2002:7f00:1::",
            "::ffff:0:7f00:1",
            "::ffff:0:a00:1",
            "64:ff9b:1::a00:1",
            "2001::1",
            "2001:2::1",
            "2001:10::1",
            "3fff::1",
            "5f00::1",
            "192.88.99.1",
            "168.63.129.16",
            "::ffff:168.63.129.16",
        ] {
            let ip: IpAddr = inside.parse().expect(inside);
            assert!(!is_public(ip), "{inside} counted as public");
        }
        for outside in [
            "8.8.8.8",
            "1.1.1.1",
            "172.32.0.1",
            "2606:4700::1111",
            "100.128.0.1",
        ] {
            let ip: IpAddr = outside.parse().expect(outside);
            assert!(is_public(ip), "{outside} counted as not public");
        }
    }

    #[test]
    fn urls_are_refused_for_their_address_in_every_spelling() {
        for url in [
            "http://127.0.0.1/hook",
            "http://0x7f.1/hook",
            "http://2130706433/hook",
            "http://0177.0.0.1/hook",
            "http://[::1]:8080/hook",
            "http://169.254.169.254/latest/meta-data",
            "https://[::ffff:7f00:1]/",
            "ftp://example.com/",
            "file:///etc/passwd",
            "https://example.com/#x",
            "https:///nohost",
            "http://8.8.8.8:0/",
        ] {
            assert!(parse(url, STRICT).is_err(), "{url} accepted");
        }
        assert!(parse("https://hooks.example.com/in?t=1", STRICT).is_ok());
        let allowed = UrlPolicy {
            allow_private: true,
        };
        assert!(parse("http://127.0.0.1:9000/hook", allowed).is_ok());
        assert!(parse("ftp://127.0.0.1/", allowed).is_err());
    }

    #[tokio::test]
    async fn a_name_that_resolves_inside_is_refused_when_saved_and_when_connecting() {
        let url = parse("http://localhost:9/hook", STRICT).expect("a name passes parsing");
        assert!(check_resolved(&url, STRICT).await.is_err());
        let client = client(STRICT, Duration::from_secs(2), 1).expect("client");
        let error = client
            .post("http://localhost:9/hook")
            .send()
            .await
            .expect_err("refused");
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&error);
        let mut refused = false;
        while let Some(e) = cause {
            refused |= e.downcast_ref::<NotPublic>().is_some();
            cause = e.source();
        }
        assert!(refused, "{error:?}");
    }
}
