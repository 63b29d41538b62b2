//! A valid shared library with no abi_stable root module.
#[no_mangle]
pub extern "C" fn not_a_plugin() -> i32 {
    42
}
