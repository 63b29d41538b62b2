//! A stand-in for another plugin-api version: same root-module name, other
//! version and layout.
#![allow(non_local_definitions)]
use abi_stable::{
    declare_root_module_statics, library::RootModule, package_version_strings,
    sabi_types::VersionStrings, std_types::RString, StableAbi,
};

#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginModRef)))]
#[sabi(missing_field(panic))]
pub struct PluginMod {
    #[sabi(last_prefix_field)]
    pub hello: extern "C" fn(u64) -> RString,
}

impl RootModule for PluginModRef {
    declare_root_module_statics! {PluginModRef}
    const BASE_NAME: &'static str = "pulsar_plugin";
    const NAME: &'static str = "pulsar_plugin";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}
