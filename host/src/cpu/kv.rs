//! The f32 KV cache: one key and one value row per position per attention
//! layer, allocated once for the context length.

use pulsar_plugin_api::ModelPlan;

pub struct LayerKv {
    kw: usize,
    vw: usize,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl LayerKv {
    pub fn write(&mut self, pos: usize, k: &[f32], v: &[f32]) -> Result<(), String> {
        let n_ctx = self.k.len() / self.kw.max(1);
        if pos >= n_ctx {
            return Err(format!("context is full: position {pos} needs a context larger than {n_ctx} (raise --ctx)"));
        }
        self.k[pos * self.kw..(pos + 1) * self.kw].copy_from_slice(k);
        self.v[pos * self.vw..(pos + 1) * self.vw].copy_from_slice(v);
        Ok(())
    }
    /// Keys of positions `[0, n)`.
    pub fn keys(&self, n: usize) -> &[f32] {
        &self.k[..n * self.kw]
    }
    pub fn values(&self, n: usize) -> &[f32] {
        &self.v[..n * self.vw]
    }
}

pub struct KvCache {
    n_ctx: usize,
    layers: Vec<Option<LayerKv>>,
}

impl KvCache {
    pub fn new(plan: &ModelPlan, n_ctx: usize) -> KvCache {
        let n_layers = plan.kv.iter().map(|k| k.layer as usize + 1).max().unwrap_or(0).max(plan.n_layers as usize);
        let mut layers: Vec<Option<LayerKv>> = (0..n_layers).map(|_| None).collect();
        for k in plan.kv.iter() {
            let kw = (k.n_kv_head * k.head_dim_k) as usize;
            let vw = (k.n_kv_head * k.head_dim_v) as usize;
            layers[k.layer as usize] = Some(LayerKv { kw, vw, k: vec![0.0; kw * n_ctx], v: vec![0.0; vw * n_ctx] });
        }
        KvCache { n_ctx, layers }
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    pub fn bytes(&self) -> usize {
        self.layers.iter().flatten().map(|l| 4 * (l.k.len() + l.v.len())).sum()
    }

    pub fn layer(&self, layer: usize) -> Result<&LayerKv, String> {
        self.layers.get(layer).and_then(|l| l.as_ref()).ok_or_else(|| format!("layer {layer} declared no KV cache"))
    }

    /// The layer's cache, checking the row widths the op uses against the plan.
    pub fn layer_mut(&mut self, layer: usize, kw: usize, vw: usize) -> Result<&mut LayerKv, String> {
        let l = self.layers.get_mut(layer).and_then(|l| l.as_mut()).ok_or_else(|| format!("layer {layer} declared no KV cache"))?;
        if l.kw != kw || l.vw != vw {
            return Err(format!("layer {layer}: attention uses k/v widths {kw}/{vw}, the plan declared {}/{}", l.kw, l.vw));
        }
        Ok(l)
    }
}
