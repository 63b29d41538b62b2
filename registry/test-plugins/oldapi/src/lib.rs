//! A plugin built against another plugin-api version (pulsar-fake-api 0.9).
use abi_stable::{export_root_module, prefix_type::PrefixTypeTrait, std_types::RString};
use pulsar_fake_api::{PluginMod, PluginModRef};

extern "C" fn hello(_: u64) -> RString {
    "hello from the past".into()
}

#[export_root_module]
pub fn root() -> PluginModRef {
    PluginMod { hello }.leak_into_prefix()
}
