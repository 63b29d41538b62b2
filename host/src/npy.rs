//! Writing NumPy `.npy` files (v1.0, little-endian float32, C order).

use std::io::Write;

pub fn write_f32(path: &std::path::Path, shape: &[usize], data: &[f32]) -> std::io::Result<()> {
    assert_eq!(shape.iter().product::<usize>(), data.len());
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_s = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_s}, }}");
    // Magic (6) + version (2) + header length (2) + header + '\n' is a multiple of 64.
    let pad = 64 - (10 + header.len() + 1) % 64;
    header.push_str(&" ".repeat(pad % 64));
    header.push('\n');
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    f.write_all(b"\x93NUMPY\x01\x00")?;
    f.write_all(&(header.len() as u16).to_le_bytes())?;
    f.write_all(header.as_bytes())?;
    for v in data {
        f.write_all(&v.to_le_bytes())?;
    }
    f.flush()
}

#[cfg(test)]
mod tests {
    #[test]
    fn header_is_aligned_and_data_follows() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.npy");
        super::write_f32(&p, &[2, 3], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
        let b = std::fs::read(&p).unwrap();
        let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
        assert_eq!((10 + hl) % 64, 0);
        assert!(std::str::from_utf8(&b[10..10 + hl]).unwrap().contains("'shape': (2, 3)"));
        assert_eq!(b.len(), 10 + hl + 24);
        assert_eq!(f32::from_le_bytes(b[10 + hl + 4..10 + hl + 8].try_into().unwrap()), 1.0);
    }
}
