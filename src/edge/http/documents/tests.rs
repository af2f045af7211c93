use super::location;

#[test]
fn locations_encode_the_id_as_one_segment() {
    assert_eq!(
        location("PROJ-9012-1001"),
        "/api/v1/documents/PROJ-9012-1001"
    );
    assert_eq!(location("PROJ/001"), "/api/v1/documents/PROJ%2F001");
    assert_eq!(location("a b?"), "/api/v1/documents/a%20b%3F");
}
