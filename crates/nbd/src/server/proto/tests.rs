use super::*;

#[test]
fn extents_are_trimmed_to_the_request() {
    let e = |length, flags| BlockDescriptor { length, flags };
    let mut v = [e(512, 1), e(512, 0), e(512, 1)];
    assert_eq!(allowed_extents(&mut v, 1024, false), 2);
    let mut v = [e(512, 1), e(512, 0), e(512, 1)];
    assert_eq!(allowed_extents(&mut v, 1025, false), 3);
    let mut v = [e(4096, 3)];
    assert_eq!(allowed_extents(&mut v, 512, false), 1);
    assert_eq!(v[0], e(4096, 3), "the last extent may run past");
    let mut v = [e(0, 3), e(512, 3)];
    assert_eq!(allowed_extents(&mut v, 2048, false), 1);
    assert_eq!(v[0], e(2048, 0));
    let mut v = [e(512, 3), e(0, 0)];
    assert_eq!(allowed_extents(&mut v, 2048, false), 1);
    assert_eq!(v[0], e(512, 3));
    let mut v = [e(4096, 3)];
    assert_eq!(allowed_extents(&mut v, 1024, true), 1);
    assert_eq!(v[0], e(1024, 3));
}

#[test]
fn payload_accounting() {
    assert_eq!(
        payload_bytes(&Command::Read {
            offset: 0,
            length: 4096,
            df: false
        }),
        4096
    );
    assert_eq!(payload_bytes(&Command::Flush), 0);
}
