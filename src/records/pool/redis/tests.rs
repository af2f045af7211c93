use super::*;

#[test]
fn pool_keys_share_one_hash_tag_and_parse_back() {
    let keys = PoolKeys::new("idpool", "PROJ", "9012", "20261122");
    assert_eq!(keys.pool, "idpool:{PROJ:9012:20261122}:pool");
    assert_eq!(keys.lock, "idpool:{PROJ:9012:20261122}:lock");
    assert_eq!(
        PoolKeys::parse_pool_key("idpool", &keys.pool),
        Some(("PROJ", "9012", "20261122"))
    );
    let never = PoolKeys::new("t1", "P", "T", "");
    assert_eq!(
        PoolKeys::parse_pool_key("t1", &never.pool),
        Some(("P", "T", ""))
    );
    assert_eq!(PoolKeys::parse_pool_key("other", &never.pool), None);
}
