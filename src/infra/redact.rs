//! What logs, errors and API answers may show of a URL that can carry
//! secrets: the one place credentials are taken out of a URL.
//!
//! The userinfo is everything up to the last `@` of the authority part,
//! as URL parsers read it. Cut there by hand first, because a password's
//! own `#`, `?`, `/` or `@` makes `url::Url` read a different URL (a port
//! and a fragment, say) in which the password is not a password any more,
//! and because a Redis Cluster's `h1:p1,h2:p2` authority is not one
//! `url::Url` parses at all.

/// `url` with any password replaced by `***`; the user and the rest are
/// kept. A `@` in the query makes more of the URL hidden, never less.
pub fn url_without_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let Some((userinfo, after)) = rest.rsplit_once('@') else {
        return url.to_owned();
    };
    match userinfo.split_once(':') {
        Some((user, _password)) => format!("{scheme}://{user}:***@{after}"),
        None => url.to_owned(),
    }
}

/// `scheme://host[:port]/path` of `url`: no userinfo, query or fragment
/// (which may carry tokens). For targets whose address is shown to
/// callers.
pub fn url_without_secrets(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "(an unparsable address)".to_owned();
    };
    let after = rest.rsplit_once('@').map_or(rest, |(_, after)| after);
    match url::Url::parse(&format!("{scheme}://{after}")) {
        Ok(parsed) => {
            let host = parsed.host_str().unwrap_or("");
            let port = parsed.port().map(|p| format!(":{p}")).unwrap_or_default();
            format!("{}://{host}{port}{}", parsed.scheme(), parsed.path())
        }
        Err(_) => "(an unparsable address)".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn passwords_are_masked_and_the_rest_kept() {
        assert_eq!(
            url_without_password("postgres://app:secret@db:5432/app"),
            "postgres://app:***@db:5432/app"
        );
        assert_eq!(
            url_without_password("redis://:secret@r:6379"),
            "redis://:***@r:6379"
        );
        assert_eq!(
            url_without_password("postgres://app:p@ss:w@rd@db/app"),
            "postgres://app:***@db/app"
        );
        assert_eq!(
            url_without_password("redis-cluster://:pw@h1:1,h2:2"),
            "redis-cluster://:***@h1:1,h2:2"
        );
        assert_eq!(
            url_without_password("postgres://db/app"),
            "postgres://db/app"
        );
        assert_eq!(
            url_without_secrets("https://u:12#B@hooks.example:8443/in?token=t#f"),
            "https://hooks.example:8443/in"
        );
    }

    /// Passwords are drawn from characters the rest of the URL never uses
    /// (capitals) and the ones that confuse URL parsers; no capital may
    /// come out.
    fn password() -> impl Strategy<Value = String> {
        "[A-Z@:/#?%=&,;]{0,12}[A-Z][A-Z@:/#?%=&,;]{0,12}"
    }

    proptest! {
        #[test]
        fn no_part_of_a_password_is_ever_shown(
            scheme in prop::sample::select(vec![
                "postgres", "postgresql", "redis", "rediss", "redis-cluster", "https",
            ]),
            user in "[a-z0-9_]{0,8}",
            password in password(),
            hosts in "[a-z][a-z0-9.]{0,10}(:[0-9]{1,5})?(,[a-z][a-z0-9]{0,6}:[0-9]{1,5}){0,2}",
            tail in "(/[a-z0-9_]{0,8})?(\\?[a-z]{1,5}=[a-z0-9]{1,5})?",
        ) {
            let url = format!("{scheme}://{user}:{password}@{hosts}{tail}");
            for shown in [url_without_password(&url), url_without_secrets(&url)] {
                prop_assert!(
                    !shown.chars().any(|c| c.is_ascii_uppercase()),
                    "{url} shown as {shown}"
                );
            }
            let masked = url_without_password(&url);
            prop_assert_eq!(masked, format!("{scheme}://{user}:***@{hosts}{tail}"));
        }
    }
}
